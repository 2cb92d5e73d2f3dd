"""The `build` job on a Windows node: llama.cpp built from source with CMake and the compiler the PC has, or
an existing install (a release zip unpacked into a folder) registered from what its programs print.

The source is the POSIX path's: a tarball from the console's tarball folder (the pinned llama.cpp sdist from
PyPI, SHA-256 checked on the console), uploaded over SFTP (Windows' OpenSSH server has it) and unpacked with
the tar.exe Windows ships since Windows 10 1803, or a git checkout where git is installed. CMake runs with
the same flags as on Linux (builds/backends.py, GGML_RPC=ON and the rest). The compiler:

- Visual Studio 2017 or later, or its Build Tools, with the C++ workload, found by vswhere.exe: CMake picks
  its Visual Studio generator by itself (llama.cpp's own Windows instructions), a multi-configuration one,
  so the programs land in build-<backend>\\bin\\Release;
- else clang or gcc (MinGW-w64, w64devkit) on the PATH with Ninja: `-G Ninja`, programs in bin\\.

What is missing is named with the winget and Chocolatey commands a person runs on the PC (`missing`), before
anything is uploaded. Layout on the node, as on POSIX under %USERPROFILE%\\.ramdeck\\llama.cpp.
"""

from __future__ import annotations

import ntpath
import os
import secrets

from django.conf import settings

from builds.backends import cmake_flags
from builds.models import BuildSource
from builds.tarballs import tarball_to_upload
from jobs.aio import db
from jobs.context import JobFailed
from llamacpp.versions import parse_rpc_protocol_header, rpc_target_of, src_dir_name
from nodes.probe.parse import split_sections
from remote.powershell import (
    build_tools_script,
    exists_script,
    make_dir_script,
    move_script,
    powershell_argv,
    remove_tree_script,
)

# How each piece is installed on Windows: winget (Windows 10 1809 and later, Windows 11) or Chocolatey.
INSTALL = {
    "cmake": (
        "winget install -e --id Kitware.CMake",
        "choco install cmake --installargs 'ADD_CMAKE_TO_PATH=System'",
    ),
    "msvc": (
        'winget install -e --id Microsoft.VisualStudio.2022.BuildTools --override "--wait --passive '
        '--add Microsoft.VisualStudio.Workload.VCTools --includeRecommended"',
        "choco install visualstudio2022buildtools visualstudio2022-workload-vctools",
    ),
    "ninja": ("winget install -e --id Ninja-build.Ninja", "choco install ninja"),
    "git": ("winget install -e --id Git.Git", "choco install git"),
    "cuda": ("winget install -e --id Nvidia.CUDA", "choco install cuda"),
    "vulkan": ("winget install -e --id KhronosGroup.VulkanSDK", "choco install vulkan-sdk"),
}
WINDOWS_BACKENDS = ("cpu", "cuda", "vulkan")


def install_hint(piece: str) -> str:
    winget, choco = INSTALL[piece]
    return f"`{winget}` (or `{choco}`)"


def parse_build_tools(text: str) -> dict[str, str]:
    """{"cmake": path, ..., "msvc": Visual Studio folder, "vulkan_sdk": ..., "home": ...} from
    remote/powershell.py's build_tools_script output (an absent program has no key)."""
    sections = split_sections(text)
    found: dict[str, str] = {}
    for line in sections.get("commands", "").splitlines():
        path = line.strip()
        name = ntpath.basename(path).lower()
        if name.endswith(".exe"):
            name = name[:-4]
        if path and name:
            found.setdefault(name, path)
    for key in ("msvc", "vulkan_sdk", "home"):
        lines = [line.strip() for line in sections.get(key, "").splitlines() if line.strip()]
        if lines:
            found[key] = lines[0]
    return found


def compiler_of(found: dict[str, str]) -> str:
    """ "msvc", "clang", "gcc", or "" when the PC has no C++ compiler CMake can use."""
    if found.get("msvc"):
        return "msvc"
    if found.get("ninja") and found.get("clang") and found.get("clang++"):
        return "clang"
    if found.get("ninja") and found.get("gcc") and found.get("g++"):
        return "gcc"
    return ""


def missing(found: dict[str, str], *, source: str, backend: str) -> list[tuple[str, str]]:
    """What the PC lacks for this build: (what, the INSTALL key of its commands, or "" when there is none)."""
    lacks: list[tuple[str, str]] = []
    if not found.get("cmake"):
        lacks.append(("CMake", "cmake"))
    if not compiler_of(found):
        if (found.get("clang") or found.get("gcc")) and not found.get("ninja"):
            compiler = "clang" if found.get("clang") else "gcc"
            lacks.append((f"Ninja, to build with the {compiler} on the PATH", "ninja"))
        else:
            lacks.append(("a C++ compiler: Visual Studio 2022 Build Tools with the C++ workload", "msvc"))
    if source == "tarball" and not found.get("tar"):
        lacks.append(("tar.exe, which Windows ships since Windows 10 1803: update Windows", ""))
    if source == "git" and not found.get("git"):
        lacks.append(("git", "git"))
    if backend == "cuda" and not found.get("nvcc"):
        lacks.append(("nvcc, the CUDA toolkit, for the NVIDIA GPU", "cuda"))
    if backend == "vulkan" and not (found.get("glslc") and found.get("vulkan_sdk")):
        lacks.append(("the Vulkan SDK (glslc, the headers and VULKAN_SDK)", "vulkan"))
    if backend not in WINDOWS_BACKENDS:
        lacks.append(
            (f"the {backend} backend, which the console builds on Linux only (here: CPU, CUDA, Vulkan)", "")
        )
    return lacks


def missing_sentence(node_name: str, backend: str, lacks: list[tuple[str, str]]) -> str:
    """The job's result: each missing piece with the winget command that installs it (the log adds
    Chocolatey's)."""
    # The winget line without its options (Build Tools' workload options are in the log): a result is short.
    pieces = "; ".join(
        f"{what} (`{INSTALL[key][0].split(' --override')[0]}`)" if key else what for what, key in lacks
    )
    return (
        f"{node_name} lacks what the {backend} build needs on Windows: {pieces}. The log has the whole "
        "commands (and Chocolatey's)."
    )


def windows_backend(requested: str, found: dict[str, str], device_kinds: set[str]) -> str:
    """The form's choice, or the PC's own: CUDA for an NVIDIA GPU, Vulkan for another GPU, else the CPU."""
    if requested and requested != "auto":
        return requested
    for kind in ("cuda", "vulkan"):
        if kind in device_kinds:
            return kind
    return "cpu"


def generator_flags(found: dict[str, str]) -> list[str]:
    """CMake's generator and compiler: none for Visual Studio (CMake finds the newest itself), Ninja with
    the compiler on the PATH otherwise."""
    compiler = compiler_of(found)
    if compiler == "clang":
        return ["-G", "Ninja", "-DCMAKE_C_COMPILER=clang", "-DCMAKE_CXX_COMPILER=clang++"]
    if compiler == "gcc":
        return ["-G", "Ninja", "-DCMAKE_C_COMPILER=gcc", "-DCMAKE_CXX_COMPILER=g++"]
    return []


def bin_dir_of(build_dir: str, found: dict[str, str]) -> str:
    """Where the programs land: Visual Studio's generator puts each configuration in a folder of its own."""
    if compiler_of(found) == "msvc":
        return ntpath.join(build_dir, "bin", "Release")
    return ntpath.join(build_dir, "bin")


async def _ps(ctx, script: str, *, timeout: float = 60, check: bool = True):
    return await ctx.run(powershell_argv(script), timeout=timeout, check=check)


async def _exists(ctx, path: str) -> bool:
    result = await ctx.transport.run(powershell_argv(exists_script(path)), timeout=30)
    return result.exit_status == 0


async def _read(ctx, path: str, nbytes: int = 1 << 20) -> str:
    return (await ctx.transport.read_head(path, nbytes)).decode("utf-8", errors="replace")


async def _tarball_tree(ctx, root: str, params: dict) -> tuple[str, str, str]:
    """The tarball's source tree on the PC: uploaded over SFTP and unpacked once per source hash."""
    local, sha = await tarball_to_upload(ctx, params)
    src = ntpath.join(root, src_dir_name(sha))
    for tree in (ntpath.join(src, "llama.cpp"), src):
        if await _exists(ctx, ntpath.join(tree, "CMakeLists.txt")):
            await ctx.log(f"source {src_dir_name(sha)} already unpacked on the node (cached by source hash)")
            return tree, sha, os.path.basename(local)
    downloads = ntpath.join(root, "dl")
    remote = ntpath.join(downloads, os.path.basename(local))
    part = f"{remote}.{secrets.token_hex(4)}.part"
    await _ps(ctx, make_dir_script(downloads))
    await ctx.log(f"uploading {os.path.basename(local)} ({os.path.getsize(local) // 2**20} MiB) over SFTP")
    await ctx.transport.upload(local, part)
    await _ps(ctx, move_script(part, remote))
    # Unpacked beside the final place and moved there, so a half-unpacked tree is never taken for a cache.
    tmp = f"{src}.{secrets.token_hex(4)}.tmp"
    await _ps(ctx, make_dir_script(tmp))
    await ctx.run(["tar", "-xzf", remote, "-C", tmp, "--strip-components=1"], timeout=1800)
    await _ps(ctx, move_script(tmp, src))
    tree = ntpath.join(src, "llama.cpp")
    if not await _exists(ctx, ntpath.join(tree, "CMakeLists.txt")):
        tree = src
    return tree, sha, os.path.basename(local)


async def _git_tree(ctx, root: str, params: dict) -> tuple[str, str, str]:
    url = params.get("git_url") or settings.RAMDECK_LLAMACPP_GIT_URL
    ref = params.get("git_ref") or settings.RAMDECK_LLAMACPP_GIT_REF
    tree = ntpath.join(root, "git", "llama.cpp")
    await _ps(ctx, make_dir_script(ntpath.join(root, "git")))
    if not await _exists(ctx, ntpath.join(tree, ".git", "HEAD")):
        await _ps(ctx, remove_tree_script(tree))
        await ctx.run(["git", "clone", "--", url, tree], timeout=3600)
    await ctx.run(["git", "-C", tree, "fetch", "--tags", "--", url, ref], timeout=3600)
    await ctx.run(["git", "-C", tree, "checkout", "--detach", "FETCH_HEAD"], timeout=600)
    return tree, "", ref


async def _compile(ctx, found: dict[str, str], tree: str, build_dir: str, flags: list[str], rebuild: bool):
    """cmake configure and build of the RPC server and llama-server; nothing when the build folder already
    holds both built with these flags. Returns the folder of the programs."""
    from builds.job import cache_has_flags

    rpc_target = "ggml-rpc-server"
    for folder in ("tools", "examples"):
        cmakelists = ntpath.join(tree, folder, "rpc", "CMakeLists.txt")
        if await _exists(ctx, cmakelists):
            rpc_target = rpc_target_of(await _read(ctx, cmakelists))
            break
    bin_dir = bin_dir_of(build_dir, found)
    programs = [ntpath.join(bin_dir, f"{name}.exe") for name in (rpc_target, "llama-server")]
    cache_path = ntpath.join(build_dir, "CMakeCache.txt")
    cached = all([await _exists(ctx, p) for p in programs]) and await _exists(ctx, cache_path)
    if cached and cache_has_flags(await _read(ctx, cache_path), flags) and not rebuild:
        await ctx.log(f"{build_dir} already holds both programs built with these flags: nothing to compile")
        return bin_dir
    generator = generator_flags(found)
    compiler = {"msvc": f"Visual Studio ({found.get('msvc')})"}.get(compiler_of(found), compiler_of(found))
    await ctx.log(f"configuring with {compiler}: cmake {' '.join(flags)}")
    await ctx.run(["cmake", "-S", tree, "-B", build_dir, *generator, *flags], timeout=1800)
    cores = int((ctx.node.facts or {}).get("cpu_cores") or 2)
    await ctx.log(f"building {rpc_target} and llama-server with {cores} cores")
    build = ["cmake", "--build", build_dir, "--config", "Release", "-j", str(cores)]
    await ctx.run(
        [*build, "--target", rpc_target, "llama-server"], timeout=settings.RAMDECK_COMMAND_TIMEOUT_S
    )
    return bin_dir


async def windows_build(ctx, params: dict, *, probe_binaries, backend_of, record) -> str:
    """The build job's body on a Windows node (builds/job.py passes its shared pieces in)."""
    source = params.get("source", "tarball")
    if source == "existing":
        probed = await probe_binaries(ctx, params["path"])
        backend = backend_of(probed["devices"]) if probed["devices"] is not None else "cpu"
        fields = {"source": params["path"], "build_dir": params["path"]}
        return await record(ctx, probed, BuildSource.EXISTING, backend, [], fields)
    answer = await ctx.transport.run(powershell_argv(build_tools_script()), timeout=60)
    found = parse_build_tools(answer.stdout)
    kinds = await db(lambda: set(ctx.node.devices.values_list("kind", flat=True)))()
    backend = windows_backend(params.get("backend", "auto"), found, kinds)
    lacks = missing(found, source=source, backend=backend)
    if lacks:
        for what, key in lacks:
            await ctx.log(f"missing: {what}" + (f": {install_hint(key)}" if key else ""))
        raise JobFailed(missing_sentence(ctx.node.name, backend, lacks))
    flags = cmake_flags(backend)
    await ctx.log(
        f"prerequisites present: cmake {found['cmake']}, compiler {compiler_of(found)}; backend {backend}"
    )
    home = found.get("home") or "C:\\"
    root = ntpath.join(home, ".ramdeck", "llama.cpp")
    if source == "tarball":
        tree, sha, label = await _tarball_tree(ctx, root, params)
        fields = {"source": label, "tarball_sha256": sha}
    elif source == "git":
        tree, sha, ref = await _git_tree(ctx, root, params)
        fields = {"source": params.get("git_url") or settings.RAMDECK_LLAMACPP_GIT_URL, "ref": ref}
    else:
        raise JobFailed(f"unknown build source {source!r}")
    build_dir = ntpath.join(tree, f"build-{backend}")
    bin_dir = await _compile(ctx, found, tree, build_dir, flags, bool(params.get("rebuild")))
    probed = await probe_binaries(ctx, bin_dir)
    if not probed["rpc_protocol"]:
        header = await _read(ctx, ntpath.join(tree, "ggml", "include", "ggml-rpc.h"))
        probed["rpc_protocol"] = parse_rpc_protocol_header(header)
    fields["build_dir"] = build_dir
    return await record(ctx, probed, BuildSource(source), backend, flags, fields)
