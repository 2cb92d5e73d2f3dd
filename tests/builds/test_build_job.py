"""The build job: its pure decisions, and registering the existing llama.cpp install on a lab host."""

from __future__ import annotations

from pathlib import Path

import pytest

from builds.backends import PREREQ_SCRIPT, cmake_env, old_vulkan_headers, os_family, vulkan_instead
from builds.job import (
    cache_has_flags,
    choose_backend,
    cmake_flags,
    missing_prerequisites,
    parse_prerequisites,
)
from builds.models import Build, BuildSource
from jobs.models import Job, JobState
from llamacpp.logs import parse_rpc_banner_version, parse_server_version
from llamacpp.versions import parse_rpc_protocol_header, protocol_mismatch, rpc_target_of, src_dir_name
from tests.deploy_fixtures import lab_node, log_text, rpc_server_binary, run
from tests.unavailable import unavailable

LINUX_ALL = """\
cmake=/usr/bin/cmake
ninja=/usr/bin/ninja
make=/usr/bin/make
c++=/usr/bin/c++
g++=/usr/bin/g++
clang++=
cc=/usr/bin/cc
tar=/usr/bin/tar
git=/usr/bin/git
nvcc=
flock=/usr/bin/flock
nproc=/usr/bin/nproc
os=Linux
arch=x86_64
home=/root
xcode=
"""

MAC_NO_CLT = """\
cmake=/opt/homebrew/bin/cmake
ninja=
make=/usr/bin/make
c++=
g++=
clang++=
tar=/usr/bin/tar
git=
os=Darwin
arch=arm64
home=/Users/leonie
xcode=
"""


def test_a_complete_linux_node_lacks_nothing():
    found = parse_prerequisites(LINUX_ALL)
    assert missing_prerequisites(found, source="tarball", backend="cpu") == []
    assert found["home"] == "/root"


def test_missing_tools_are_named_as_a_person_installs_them():
    found = parse_prerequisites(MAC_NO_CLT)
    missing = missing_prerequisites(found, source="git", backend="metal")
    assert "a C++ compiler (g++ or clang++)" in missing
    assert "git" in missing
    assert "Xcode command line tools (xcode-select --install)" in missing
    assert "cmake" not in missing


def test_a_bare_debian_node_is_told_the_one_line_that_brings_every_build_tool():
    bare = LINUX_ALL.replace("cmake=/usr/bin/cmake", "cmake=").replace("g++=/usr/bin/g++", "g++=")
    bare = bare.replace("c++=/usr/bin/c++", "c++=") + "distro=ubuntu debian\n"
    missing = missing_prerequisites(parse_prerequisites(bare), source="tarball", backend="cpu")
    assert missing == [
        "cmake",
        "a C++ compiler (g++ or clang++)",
        "the build tools in one go: sudo apt-get install build-essential cmake git",
    ]
    mac = missing_prerequisites(parse_prerequisites(MAC_NO_CLT), source="git", backend="metal")
    assert "the build tools in one go: brew install cmake" in mac


def test_an_nvidia_node_needs_nvcc():
    found = parse_prerequisites(LINUX_ALL)
    assert choose_backend("auto", found, {"cuda", "cpu"}) == "cuda"
    assert missing_prerequisites(found, source="tarball", backend="cuda") == [
        "nvcc (the CUDA toolkit) for the NVIDIA GPU"
    ]


def test_backend_choice_and_flags():
    assert choose_backend("auto", {"os": "Darwin"}, set()) == "metal"
    assert choose_backend("auto", {"os": "Linux"}, {"cpu"}) == "cpu"
    assert choose_backend("vulkan", {"os": "Linux"}, {"cpu"}) == "vulkan"
    flags = cmake_flags("cuda")
    assert "-DGGML_RPC=ON" in flags and "-DGGML_CUDA=ON" in flags and "-DLLAMA_CURL=OFF" in flags
    assert "-DGGML_CUDA=ON" not in cmake_flags("metal")


@pytest.mark.llamacpp
def test_the_cached_build_already_holds_the_cpu_flags_but_not_cuda():
    # The build the other tests use (skips without it, fails under CI=true): its folder holds bin/.
    from tests.llamacpp_build import require_llamacpp

    cache = (require_llamacpp().rpc_server.parent.parent / "CMakeCache.txt").read_text()
    assert cache_has_flags(cache, cmake_flags("cpu"))
    assert not cache_has_flags(cache, cmake_flags("cuda"))


def test_versions_and_protocols_are_read_from_their_sources():
    header = (
        "#define RPC_PROTO_MAJOR_VERSION    7\n#define RPC_PROTO_MINOR_VERSION    0\n"
        "#define RPC_PROTO_PATCH_VERSION    0\n"
    )
    assert parse_rpc_protocol_header(header) == "7.0.0"
    assert parse_rpc_protocol_header("#define RPC_PROTO_MAJOR_VERSION 3\n") == ""
    assert parse_rpc_banner_version("Starting RPC server v3.1.0\n  endpoint : 127.0.0.1:1") == "3.1.0"
    assert parse_server_version("version: 6800 (abc1234)\nbuilt with cc") == "6800 (abc1234)"
    assert (
        rpc_target_of("set(TARGET ggml-rpc-server)\nadd_executable(${TARGET} rpc-server.cpp)")
        == "ggml-rpc-server"
    )
    assert rpc_target_of("set(TARGET rpc-server)\nadd_executable(${TARGET} rpc-server.cpp)") == "rpc-server"
    assert src_dir_name("b0a2feb64c6fbd09" + "0" * 48) == "src-b0a2feb64c6fbd09"


def test_different_rpc_protocols_are_refused_by_name():
    assert protocol_mismatch({"desk": "7.0.0", "mac": "7.0.0"}) == ""
    reason = protocol_mismatch({"desk": "7.0.0", "old-pc": "3.0.0"})
    assert "old-pc speaks 3.0.0" in reason and "desk speaks 7.0.0" in reason


@pytest.mark.lab
@pytest.mark.llamacpp
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_an_existing_install_is_registered_after_running_it(lab, lab_host):
    rpc_server = rpc_server_binary()
    node = lab_node(lab, lab_host)
    job = run(
        Job.objects.create(
            kind="build", node=node, params={"source": "existing", "path": str(rpc_server.parent)}
        )
    )
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job))
    build = Build.objects.get(node=node)
    assert build.source_kind == BuildSource.EXISTING
    assert (build.rpc_binary, build.rpc_protocol) == ("ggml-rpc-server", "7.0.0")
    assert build.llama_server_path.endswith("/llama-server")
    assert build.version
    assert node.current_build == build


@pytest.mark.lab
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_a_path_without_llama_cpp_is_refused(lab, lab_host, tmp_path):
    node = lab_node(lab, lab_host)
    job = run(
        Job.objects.create(kind="build", node=node, params={"source": "existing", "path": str(tmp_path)})
    )
    assert job.state == JobState.FAILED
    assert "holds no ggml-rpc-server/rpc-server and llama-server" in job.result
    assert not Build.objects.exists()


MINI_FILES = {
    "llama.cpp/CMakeLists.txt": """
cmake_minimum_required(VERSION 3.14)
project(mini CXX)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_subdirectory(tools/rpc)
add_executable(llama-server server.cpp)
""",
    "llama.cpp/tools/rpc/CMakeLists.txt": (
        "set(TARGET ggml-rpc-server)\nadd_executable(${TARGET} rpc-server.cpp)\n"
    ),
    "llama.cpp/ggml/include/ggml-rpc.h": (
        "#define RPC_PROTO_MAJOR_VERSION 7\n#define RPC_PROTO_MINOR_VERSION 0\n"
        "#define RPC_PROTO_PATCH_VERSION 0\n"
    ),
    "llama.cpp/server.cpp": (
        '#include <cstdio>\nint main() { std::fprintf(stderr, "version: 42 (mini)\\n"); }\n'
    ),
    "llama.cpp/tools/rpc/rpc-server.cpp": (
        "#include <cstdio>\n#include <unistd.h>\n"
        'int main() { std::printf("Starting RPC server v7.0.0\\n  transport      : TCP\\n"); '
        "std::fflush(stdout); sleep(30); }\n"
    ),
}


def _mini_tarball(tmp_path, version: str = "1.0", extra: dict[str, str] | None = None) -> str:
    """A llama.cpp-shaped source tarball (the sdist layout: one top folder holding llama.cpp/) that builds
    in seconds with the real cmake and compiler; `extra` adds files."""
    import tarfile

    top = tmp_path / f"mini-{version}"
    for name, text in {**MINI_FILES, **(extra or {})}.items():
        (top / name).parent.mkdir(parents=True, exist_ok=True)
        (top / name).write_text(text)
    archive = tmp_path / f"mini-{version}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(top, arcname=f"mini-{version}")
    return str(archive)


@pytest.mark.lab
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_a_tarball_is_uploaded_unpacked_built_and_then_found_cached(lab, lab_host, tmp_path, settings):
    from llamacpp.source import file_sha256

    settings.RAMDECK_BUILD_ROOT = str(tmp_path / "root")
    tarball = _mini_tarball(tmp_path)
    settings.RAMDECK_TARBALL_DIR = str(tmp_path)  # builds upload only from the tarball folder
    sha = file_sha256(tarball)
    node = lab_node(lab, lab_host)
    params = {"source": "tarball", "tarball": tarball, "backend": "cpu"}

    first = run(Job.objects.create(kind="build", node=node, params=params))
    assert first.state == JobState.SUCCEEDED, (first.result, log_text(first)[-3000:])
    text = log_text(first)
    assert "uploading mini-1.0.tar.gz" in text
    assert "$ flock " in text and "-DGGML_RPC=ON" in text
    build = Build.objects.get(job_id=first.pk)
    tree = tmp_path / "root" / f"src-{sha[:16]}" / "llama.cpp"
    assert build.build_dir == str(tree / "build-cpu")
    assert (build.rpc_binary, build.rpc_protocol, build.version) == ("ggml-rpc-server", "7.0.0", "42 (mini)")
    assert build.tarball_sha256 == sha
    assert (tree / "build-cpu" / "bin" / "llama-server").exists()
    assert not list((tmp_path / "root").glob("*.tmp"))  # the unpack folder was moved into place

    second = run(Job.objects.create(kind="build", node=node, params=params))
    assert second.state == JobState.SUCCEEDED, second.result
    text = log_text(second)
    assert "already unpacked on the node (cached by source hash)" in text
    assert "nothing to compile" in text
    assert "uploading" not in text


@pytest.mark.lab
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_two_nodes_building_into_one_shared_folder_at_once_do_not_clash(lab, lab_hosts, tmp_path, settings):
    """The lab hosts share this file system, as NFS-mounted homes would: the unpack and the compile are
    serialised by flock, and the second build finds the first one's result."""
    import threading

    settings.RAMDECK_BUILD_ROOT = str(tmp_path / "root")
    tarball = _mini_tarball(tmp_path)
    settings.RAMDECK_TARBALL_DIR = str(tmp_path)  # builds upload only from the tarball folder
    nodes = [lab_node(lab, host) for host in lab_hosts(2)]
    params = {"source": "tarball", "tarball": tarball, "backend": "cpu"}
    jobs = [Job.objects.create(kind="build", node=node, params=params) for node in nodes]
    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=240)
    for job in jobs:
        job.refresh_from_db()
        assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-2000:])
    assert len({b.build_dir for b in Build.objects.all()}) == 1
    assert len(list((tmp_path / "root").glob("src-*/llama.cpp"))) == 1
    assert not list((tmp_path / "root").glob("*.tmp"))


@pytest.mark.lab
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_a_git_source_is_cloned_at_its_ref_and_built(lab, lab_host, tmp_path, settings):
    """No machine here reaches GitHub; a repository on the shared file system stands in for the URL."""
    import subprocess

    settings.RAMDECK_BUILD_ROOT = str(tmp_path / "root")
    repo = tmp_path / "llama.cpp.git"
    for name, text in MINI_FILES.items():
        target = repo / name.removeprefix("llama.cpp/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.test"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "mini"], check=True)
    subprocess.run([*git, "tag", "b9999"], check=True)
    node = lab_node(lab, lab_host)
    params = {"source": "git", "git_url": str(repo), "git_ref": "b9999", "backend": "cpu"}
    job = run(Job.objects.create(kind="build", node=node, params=params))
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-3000:])
    build = Build.objects.get(node=node)
    assert (build.source_kind, build.source, build.ref) == (BuildSource.GIT, str(repo), "b9999")
    assert build.build_dir == str(tmp_path / "root" / "git" / "llama.cpp" / "build-cpu")
    assert build.rpc_protocol == "7.0.0"


# -- GPU backends: ROCm and Vulkan ------------------------------------------------------------------------

ROCM_NODE = (
    LINUX_ALL
    + """\
distro=ubuntu debian
hipconfig=/opt/rocm/bin/hipconfig
hip_clang=/opt/rocm/llvm/bin
hip_path=/opt/rocm
hipblas=/opt/rocm/lib/cmake/hipblas
rocblas=/opt/rocm/lib/cmake/rocblas
vulkan_headers=
spirv_headers=
vulkan_icd=
"""
)

FEDORA_VULKAN_NODE = (
    LINUX_ALL
    + """\
distro=fedora
glslc=
vulkaninfo=/usr/bin/vulkaninfo
vulkan_headers=
spirv_headers=
vulkan_icd= radeon_icd.x86_64.json lvp_icd.x86_64.json
"""
)


def test_a_rocm_node_is_built_with_hip_for_the_targets_the_probe_found():
    found = parse_prerequisites(ROCM_NODE)
    assert choose_backend("auto", found, {"cpu", "rocm"}) == "rocm"
    assert missing_prerequisites(found, source="tarball", backend="rocm", gpu_targets=["gfx1100"]) == []
    flags = cmake_flags("rocm", ["gfx1100", "gfx1030", "gfx1100"])
    assert "-DGGML_HIP=ON" in flags and "-DAMDGPU_TARGETS=gfx1030;gfx1100" in flags
    assert "-DGGML_RPC=ON" in flags
    # CMake finds HIP's clang through HIPCXX and HIP_PATH, as llama.cpp's build guide says.
    assert cmake_env("rocm", found) == ["env", "HIPCXX=/opt/rocm/llvm/bin/clang", "HIP_PATH=/opt/rocm"]
    assert cmake_env("cpu", found) == []


def test_a_rocm_node_without_the_hip_sdk_is_told_the_packages_of_its_os():
    found = parse_prerequisites(LINUX_ALL + "distro=arch\n")
    missing = missing_prerequisites(found, source="tarball", backend="rocm", gpu_targets=["gfx1030"])
    assert missing == ["ROCm's HIP compiler, hipconfig (sudo pacman -S rocm-hip-sdk)"]
    no_blas = parse_prerequisites(ROCM_NODE.replace("hipblas=/opt/rocm/lib/cmake/hipblas", "hipblas="))
    assert missing_prerequisites(no_blas, source="tarball", backend="rocm", gpu_targets=["gfx1030"]) == [
        "hipBLAS and rocBLAS (sudo apt-get install libhipblas-dev librocblas-dev)"
    ]
    [why] = missing_prerequisites(parse_prerequisites(ROCM_NODE), source="git", backend="rocm")
    assert why.startswith("the AMD GPU's target (gfx…): the probe found none")


def test_a_vulkan_node_is_told_each_missing_piece_with_its_package():
    found = parse_prerequisites(FEDORA_VULKAN_NODE)
    assert choose_backend("auto", found, {"cpu", "vulkan"}) == "vulkan"
    assert "-DGGML_VULKAN=ON" in cmake_flags("vulkan")
    assert missing_prerequisites(found, source="tarball", backend="vulkan") == [
        "glslc, the shader compiler (sudo dnf install glslc)",
        "the Vulkan headers and loader (sudo dnf install vulkan-headers vulkan-loader-devel)",
        "the SPIR-V headers (sudo dnf install spirv-headers-devel)",
    ]
    mac = parse_prerequisites(MAC_NO_CLT)
    assert "a Vulkan driver (brew install molten-vk)" in missing_prerequisites(
        mac, source="tarball", backend="vulkan"
    )
    # An OS we do not know gets every family's names.
    [driver, *_] = missing_prerequisites(parse_prerequisites(LINUX_ALL), source="tarball", backend="vulkan")
    assert "Debian/Ubuntu: sudo apt-get install mesa-vulkan-drivers" in driver
    assert "Fedora: sudo dnf install mesa-vulkan-drivers" in driver and "Arch: sudo pacman -S" in driver


def test_a_rocm_node_that_can_build_vulkan_is_told_so():
    found = parse_prerequisites(
        LINUX_ALL + "distro=debian\nvulkan_icd= radeon_icd.x86_64.json\nglslc=/usr/bin/glslc\n"
        "vulkan_headers=/usr/include/vulkan/vulkan.h\nspirv_headers=/usr/include/spirv/unified1/spirv.hpp\n"
    )
    assert "choose Vulkan on the build form" in vulkan_instead(found, "rocm")
    assert vulkan_instead(parse_prerequisites(ROCM_NODE), "rocm") == ""


def test_the_prerequisite_script_runs_here_and_names_this_debian():
    import subprocess

    result = subprocess.run(["sh", "-c", PREREQ_SCRIPT], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    found = parse_prerequisites(result.stdout)
    assert os_family(found) == "debian"
    assert found["cmake"] and "vulkan_icd" in found and "spirv_headers" in found and "hipconfig" in found
    assert "vulkan_layer_settings" in found


def test_vulkan_headers_without_layer_settings_are_named_with_what_to_install():
    debian = parse_prerequisites(
        "distro=debian\nvulkan_headers=/usr/include/vulkan/vulkan.h\nvulkan_layer_settings=\n"
    )
    why = old_vulkan_headers(debian, os_family(debian))
    assert why.startswith("its Vulkan headers (/usr/include/vulkan/vulkan.h) lack VK_EXT_layer_settings")
    assert "Debian 13's libvulkan-dev, or LunarG's Vulkan SDK with VULKAN_SDK set" in why
    assert old_vulkan_headers({**debian, "vulkan_layer_settings": "yes"}, "debian") == ""


def old_vulkan_sdk(folder) -> str:
    """A Vulkan SDK folder whose headers predate VK_EXT_layer_settings, as Debian 12's 1.3.239 do."""
    for name, text in {
        "include/vulkan/vulkan.h": '#include "vulkan_core.h"\n',
        "include/vulkan/vulkan_core.h": "#define VK_HEADER_VERSION 239\n#define VK_EXT_debug_utils 1\n",
        "include/spirv/unified1/spirv.hpp": "namespace spv {}\n",
    }.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return str(folder)


@pytest.mark.lab
@pytest.mark.timeout(300)
@pytest.mark.django_db(transaction=True)
def test_a_vulkan_build_with_headers_too_old_for_the_source_is_refused_before_compiling(
    lab, lab_host, tmp_path, settings
):
    """Over real SSH, on a node whose Vulkan SDK (VULKAN_SDK, which CMake's FindVulkan takes first) has
    headers without VK_EXT_layer_settings: a source whose Vulkan backend uses it is refused before cmake
    runs, naming what to install; a source that does not use it builds."""
    import shutil

    if not (shutil.which("glslc") and list(Path("/usr/share/vulkan/icd.d").glob("*.json"))):
        unavailable("glslc and a Vulkan driver are needed here (make install-system-deps installs them)")
    sdk = old_vulkan_sdk(tmp_path / "sdk")
    lab.start_sshd(lab_host, extra_config=[f"SetEnv VULKAN_SDK={sdk}"])
    settings.RAMDECK_BUILD_ROOT = str(tmp_path / "root")
    settings.RAMDECK_TARBALL_DIR = str(tmp_path)
    node = lab_node(lab, lab_host)
    uses = {"llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp": "std::vector<vk::LayerSettingEXT> settings;\n"}
    tarball = _mini_tarball(tmp_path, "new", uses)
    job = run(
        Job.objects.create(
            kind="build", node=node, params={"source": "tarball", "tarball": tarball, "backend": "vulkan"}
        )
    )
    assert job.state == JobState.FAILED, log_text(job)[-2000:]
    assert (
        f"{node.name} cannot build this llama.cpp with Vulkan: its Vulkan headers ({sdk}/include"
        in job.result
    )
    assert "lack VK_EXT_layer_settings" in job.result and "Debian 13's libvulkan-dev" in job.result
    assert "configuring" not in log_text(job)
    assert not Build.objects.exists()

    older = _mini_tarball(tmp_path, "old", {"llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp": "int x;\n"})
    job = run(
        Job.objects.create(
            kind="build", node=node, params={"source": "tarball", "tarball": older, "backend": "vulkan"}
        )
    )
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job)[-2000:])
    assert "-DGGML_VULKAN=ON" in log_text(job)
    assert Build.objects.get().backend == "vulkan"


@pytest.mark.lab
@pytest.mark.timeout(120)
@pytest.mark.django_db(transaction=True)
def test_a_rocm_node_is_never_built_for_the_cpu_and_is_told_what_rocm_needs(lab, lab_host):
    from nodes.models import Device

    node = lab_node(lab, lab_host, facts={"amdgpu_targets": ["gfx1100"]})
    Device.objects.create(node=node, name="ROCm0", kind="rocm", total_bytes=24 << 30, free_bytes=23 << 30)
    job = run(Job.objects.create(kind="build", node=node, params={"source": "tarball", "backend": "auto"}))
    assert job.state == JobState.FAILED
    assert f"{node.name} lacks what the rocm build needs" in job.result
    assert "ROCm's HIP compiler, hipconfig (sudo apt-get install hipcc libamdhip64-dev" in job.result
    assert not Build.objects.exists()
