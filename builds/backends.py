"""Which llama.cpp backend a node is built with, its CMake flags, and what the node lacks for it.

Pure decisions over what the build job's prerequisite script printed (`PREREQ_SCRIPT`: "name=value" lines).
A backend the node cannot build is refused with every missing piece named by the package that brings it on
the node's own OS (Debian/Ubuntu, Fedora, Arch, macOS with Homebrew), never guessed at compile time.

- CUDA (`-DGGML_CUDA=ON`) needs nvcc.
- ROCm (`-DGGML_HIP=ON -DAMDGPU_TARGETS=gfx…`) needs HIP's clang and hipBLAS/rocBLAS; the targets are the
  GPUs the probe found (rocm-smi's "GFX Version", or the kernel's KFD topology), so only those are compiled.
  CMake runs with HIPCXX and HIP_PATH from `hipconfig`, as llama.cpp's build guide says.
- Vulkan (`-DGGML_VULKAN=ON`) needs a Vulkan driver (an ICD), glslc, and the Vulkan and SPIR-V headers,
  looked for where CMake's FindVulkan looks (the SDK named by VULKAN_SDK first). Current llama.cpp trees use
  VK_EXT_layer_settings, which older Vulkan headers lack (Debian 12's libvulkan-dev 1.3.239 does): a tree that
  uses it is refused on such a node before anything compiles (`old_vulkan_headers`).
"""

from __future__ import annotations

import posixpath

COMMON_FLAGS = [
    "-DGGML_RPC=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    # Recent trees download llama-server's web UI from Hugging Face at build time; nodes on an offline LAN
    # cannot, and the console talks to the server's API only.
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
]

BACKEND_FLAGS = {
    "cpu": [],
    "metal": [],
    "cuda": ["-DGGML_CUDA=ON"],
    "rocm": ["-DGGML_HIP=ON"],
    "vulkan": ["-DGGML_VULKAN=ON"],
}

# Prints "name=value" lines. Constant text: no input is formatted into it. ROCm lives in /opt/rocm, off the
# PATH unless the person added it; headers are looked for where the packages below put them.
PREREQ_SCRIPT = r"""
for t in cmake ninja make c++ g++ clang++ cc tar git nvcc flock nproc glslc vulkaninfo; do
  printf "%s=%s\n" "$t" "$(command -v $t 2>/dev/null)"; done
printf "os=%s\n" "$(uname -s)"; printf "arch=%s\n" "$(uname -m)"
printf "home=%s\n" "$HOME"
if xcode-select -p >/dev/null 2>&1; then echo "xcode=yes"; else echo "xcode="; fi
if [ -r /etc/os-release ]; then (. /etc/os-release; printf "distro=%s %s\n" "$ID" "$ID_LIKE"); fi
hipconfig=$(command -v hipconfig 2>/dev/null)
[ -z "$hipconfig" ] && [ -x /opt/rocm/bin/hipconfig ] && hipconfig=/opt/rocm/bin/hipconfig
printf "hipconfig=%s\n" "$hipconfig"
if [ -n "$hipconfig" ]; then
  hip_path=$("$hipconfig" -R 2>/dev/null)
  printf "hip_clang=%s\n" "$("$hipconfig" -l 2>/dev/null)"; printf "hip_path=%s\n" "$hip_path"
  for lib in hipblas rocblas; do
    found=""
    for d in "$hip_path/lib/cmake/$lib" "$hip_path/lib64/cmake/$lib" /usr/lib/*/cmake/$lib \
        /usr/lib64/cmake/$lib /usr/lib/cmake/$lib; do
      [ -d "$d" ] && { found=$d; break; }
    done
    printf "%s=%s\n" "$lib" "$found"
  done
fi
for pair in vulkan_headers:vulkan/vulkan.h spirv_headers:spirv/unified1/spirv.hpp; do
  found=""
  for d in "${VULKAN_SDK:-/nonexistent}/include" /usr/include /usr/local/include /opt/homebrew/include; do
    [ -e "$d/${pair#*:}" ] && { found="$d/${pair#*:}"; break; }
  done
  printf "%s=%s\n" "${pair%%:*}" "$found"
done
core=""
for d in "${VULKAN_SDK:-/nonexistent}/include" /usr/include /usr/local/include /opt/homebrew/include; do
  [ -e "$d/vulkan/vulkan_core.h" ] && { core="$d/vulkan/vulkan_core.h"; break; }
done
layer=""
[ -n "$core" ] && grep -q VK_EXT_layer_settings "$core" 2>/dev/null && layer=yes
printf "vulkan_layer_settings=%s\n" "$layer"
icds=""
for d in /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d \
    /opt/homebrew/share/vulkan/icd.d /opt/homebrew/etc/vulkan/icd.d; do
  for f in "$d"/*.json; do [ -e "$f" ] && icds="$icds ${f##*/}"; done
done
printf "vulkan_icd=%s\n" "$icds"
"""

# What brings each piece, per OS family (`os_family`). Names are the distributions' own packages.
PACKAGES: dict[str, dict[str, str]] = {
    # cmake, make (or ninja), a C++ compiler, tar and git; on a Mac the compiler and git come with Xcode's
    # command line tools (`xcode-select --install`).
    "build_tools": {
        "debian": "build-essential cmake git",
        "fedora": "gcc-c++ make cmake git tar",
        "arch": "base-devel cmake git",
        "macos": "cmake",
    },
    "vulkan_driver": {
        "debian": "mesa-vulkan-drivers",
        "fedora": "mesa-vulkan-drivers",
        "arch": "vulkan-radeon (AMD) or vulkan-intel (Intel)",
        "macos": "molten-vk",
    },
    "glslc": {"debian": "glslc", "fedora": "glslc", "arch": "shaderc", "macos": "shaderc"},
    "vulkan_headers": {
        "debian": "libvulkan-dev",
        "fedora": "vulkan-headers vulkan-loader-devel",
        "arch": "vulkan-headers vulkan-icd-loader",
        "macos": "vulkan-headers vulkan-loader",
    },
    "spirv_headers": {
        "debian": "spirv-headers",
        "fedora": "spirv-headers-devel",
        "arch": "spirv-headers",
        "macos": "spirv-headers",
    },
    "hip": {
        "debian": "hipcc libamdhip64-dev (or rocm-hip-sdk from AMD's ROCm repository)",
        "fedora": "rocm-hip-devel",
        "arch": "rocm-hip-sdk",
    },
    "hipblas": {
        "debian": "libhipblas-dev librocblas-dev",
        "fedora": "hipblas-devel rocblas-devel",
        "arch": "hipblas rocblas",
    },
}
_INSTALL = {
    "debian": "sudo apt-get install {}",
    "fedora": "sudo dnf install {}",
    "arch": "sudo pacman -S {}",
    "macos": "brew install {}",
}
_FAMILY_LABELS = {"debian": "Debian/Ubuntu", "fedora": "Fedora", "arch": "Arch", "macos": "macOS"}


def parse_prerequisites(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            found[key.strip()] = value.strip()
    return found


def os_family(found: dict[str, str]) -> str:
    """ "debian", "fedora", "arch", "macos", or "" when the node's OS is none of those (or unknown)."""
    if found.get("os") == "Darwin":
        return "macos"
    words = set(found.get("distro", "").lower().split())
    for family, names in (
        ("debian", {"debian", "ubuntu", "raspbian", "linuxmint", "pop"}),
        ("fedora", {"fedora", "rhel", "centos", "rocky", "almalinux"}),
        ("arch", {"arch", "manjaro", "endeavouros"}),
    ):
        if words & names:
            return family
    return ""


def packages_for(piece: str, family: str) -> str:
    """How a person installs `piece` on this OS family: the command, or every family's names when the OS is
    not one we know."""
    names = PACKAGES[piece]
    if family in names:
        return _INSTALL[family].format(names[family])
    return "; ".join(f"{_FAMILY_LABELS[f]}: {_INSTALL[f].format(n)}" for f, n in names.items())


def choose_backend(requested: str, found: dict[str, str], device_kinds: set[str]) -> str:
    """The form's choice, or the node's own: Metal on a Mac, then CUDA, ROCm, Vulkan for the GPUs the probe
    found, else the CPU."""
    if requested and requested != "auto":
        return requested
    if found.get("os") == "Darwin":
        return "metal"
    for kind in ("cuda", "rocm", "vulkan"):
        if kind in device_kinds:
            return kind
    return "cpu"


def cmake_flags(backend: str, gpu_targets: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The CMake flags of a backend; a ROCm build names the GPU targets it compiles for."""
    flags = [*COMMON_FLAGS, *BACKEND_FLAGS.get(backend, [])]
    if backend == "rocm" and gpu_targets:
        flags.append(f"-DAMDGPU_TARGETS={';'.join(sorted(set(gpu_targets)))}")
    return flags


def cmake_env(backend: str, found: dict[str, str]) -> list[str]:
    """`env NAME=value …` to put before cmake: HIP's compiler and path for ROCm, nothing otherwise."""
    if backend != "rocm" or not found.get("hip_clang"):
        return []
    hipcxx = posixpath.join(found["hip_clang"], "clang")
    return ["env", f"HIPCXX={hipcxx}", f"HIP_PATH={found.get('hip_path', '')}"]


def _vulkan_missing(found: dict[str, str], family: str) -> list[str]:
    missing = []
    if not found.get("vulkan_icd"):
        missing.append(f"a Vulkan driver ({packages_for('vulkan_driver', family)})")
    if not found.get("glslc"):
        missing.append(f"glslc, the shader compiler ({packages_for('glslc', family)})")
    if not found.get("vulkan_headers"):
        missing.append(f"the Vulkan headers and loader ({packages_for('vulkan_headers', family)})")
    if not found.get("spirv_headers"):
        missing.append(f"the SPIR-V headers ({packages_for('spirv_headers', family)})")
    return missing


def _rocm_missing(found: dict[str, str], family: str, gpu_targets: list[str]) -> list[str]:
    if family == "macos":
        return ["ROCm, which does not run on macOS (build with Metal)"]
    missing = []
    if not (found.get("hipconfig") and found.get("hip_clang")):
        missing.append(f"ROCm's HIP compiler, hipconfig ({packages_for('hip', family)})")
    if found.get("hipconfig") and not (found.get("hipblas") and found.get("rocblas")):
        missing.append(f"hipBLAS and rocBLAS ({packages_for('hipblas', family)})")
    if not gpu_targets:
        missing.append(
            "the AMD GPU's target (gfx…): the probe found none; probe the node again once rocm-smi runs there"
        )
    return missing


def missing_prerequisites(
    found: dict[str, str], *, source: str, backend: str, gpu_targets: list[str] | tuple[str, ...] = ()
) -> list[str]:
    """What the node lacks for this build, each named as a person would install it."""
    missing = []
    if source == "existing":
        return missing
    family = os_family(found)
    if not found.get("cmake"):
        missing.append("cmake")
    if not (found.get("ninja") or found.get("make")):
        missing.append("ninja or make")
    if not any(found.get(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++ or clang++)")
    if source == "tarball" and not found.get("tar"):
        missing.append("tar")
    if source == "git" and not found.get("git"):
        missing.append("git")
    if missing:
        missing.append(f"the build tools in one go: {packages_for('build_tools', family)}")
    if backend == "cuda" and not found.get("nvcc"):
        missing.append("nvcc (the CUDA toolkit) for the NVIDIA GPU")
    if backend == "rocm":
        missing += _rocm_missing(found, family, list(gpu_targets))
    if backend == "vulkan":
        missing += _vulkan_missing(found, family)
    if found.get("os") == "Darwin" and not found.get("xcode"):
        missing.append("Xcode command line tools (xcode-select --install)")
    return missing


def vulkan_instead(found: dict[str, str], backend: str) -> str:
    """A hint when a GPU backend cannot be built but Vulkan, which drives the same GPU, can."""
    if backend in ("rocm", "cuda") and not _vulkan_missing(found, os_family(found)):
        return " The node has everything the Vulkan backend needs: choose Vulkan on the build form instead."
    return ""


def old_vulkan_headers(found: dict[str, str], family: str) -> str:
    """Why a node's Vulkan headers cannot build a tree whose Vulkan backend uses VK_EXT_layer_settings
    (ggml-vulkan.cpp's vk::LayerSettingEXT), or "" when they can."""
    if found.get("vulkan_layer_settings"):
        return ""
    newer = {
        "debian": "Debian 13's libvulkan-dev, or LunarG's Vulkan SDK with VULKAN_SDK set",
        "macos": "brew upgrade vulkan-headers, or LunarG's Vulkan SDK with VULKAN_SDK set",
    }.get(family, "a newer Vulkan headers package, or LunarG's Vulkan SDK with VULKAN_SDK set")
    return (
        f"its Vulkan headers ({found.get('vulkan_headers') or 'none found'}) lack VK_EXT_layer_settings, "
        f"which this llama.cpp source's Vulkan backend uses: install newer ones ({newer}), then build again"
    )
