"""The `build` job: llama.cpp with RPC on a node, from git, an uploaded tarball, or an existing install.

Layout on the node (RAMDECK_BUILD_ROOT, default ~/.ramdeck/llama.cpp):

    <root>/dl/<tarball name>                         uploaded source tarballs
    <root>/src-<first 16 hex of sha256>/llama.cpp/   the source tree of a tarball (cached by source hash)
    <root>/git/llama.cpp/                            the git checkout
    <tree>/build-<backend>/bin/                      ggml-rpc-server (or legacy rpc-server) and llama-server

A build directory is reused: when its binaries exist and its CMake cache already holds the requested flags,
nothing is compiled (the cache); otherwise cmake reconfigures and ninja rebuilds incrementally. Every step
that writes into a shared directory runs under `flock`, so nodes that share a file system do not clash.

Job params: {"source": "tarball"|"git"|"existing", "tarball": console-local path, "tarball_sha256",
"git_url", "git_ref", "backend": "auto"|"cpu"|"cuda"|"rocm"|"metal"|"vulkan", "rebuild": bool,
"path": bin dir}. Backends, their flags and what each needs on the node: builds/backends.py."""

from __future__ import annotations

import os
import posixpath
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings

from builds import rpc_threshold
from builds.amx import NO_AMX, amx_check_argv, amx_flags, amx_verdict
from builds.backends import (
    PREREQ_SCRIPT,
    choose_backend,
    cmake_env,
    cmake_flags,
    missing_prerequisites,
    old_vulkan_headers,
    os_family,
    parse_prerequisites,
    vulkan_instead,
)
from builds.models import Build, BuildSource
from builds.tarballs import tarball_to_upload
from builds.windows import windows_build
from jobs.aio import db
from jobs.context import JobFailed
from jobs.on_node import join, on_windows, read_rpc_banner
from llamacpp.args import RPC_SERVER_BINARIES as RPC_BINARIES
from llamacpp.logs import parse_rpc_banner, parse_server_version
from llamacpp.versions import parse_rpc_protocol_header, rpc_target_of, src_dir_name
from remote.powershell import exists_script, powershell_argv
from remote.text import printable

# How many of the devices its rpc-server's banner lists a Build keeps.
MAX_BANNER_DEVICES = 32

# What the apps above builds do once a build is recorded, each registered in its AppConfig.ready() (builds
# imports none of them): calibration queues the node's first calibration. A hook takes the Build, runs in
# synchronous code, and returns a sentence for the build's log, or "".
AFTER_RECORDED: list[Callable[[Build], str]] = []


def after_recorded(hook: Callable[[Build], str]) -> None:
    """Register `hook` to run after every recorded build (once per hook, however often it is registered)."""
    if hook not in AFTER_RECORDED:
        AFTER_RECORDED.append(hook)


def cache_has_flags(cmake_cache: str, flags: list[str]) -> bool:
    """True when a CMakeCache.txt already holds every -DNAME=VALUE of `flags` (no reconfigure needed)."""
    values = {}
    for line in cmake_cache.splitlines():
        match = re.match(r"^([A-Za-z0-9_]+):[A-Z]+=(.*)$", line)
        if match:
            values[match.group(1)] = match.group(2)
    for flag in flags:
        name, _, value = flag[2:].partition("=")
        if values.get(name, "").upper() != value.upper():
            return False
    return True


@dataclass
class Layout:
    root: str
    tree: str
    build_dir: str
    backend: str = "cpu"

    @property
    def bin_dir(self) -> str:
        return posixpath.join(self.build_dir, "bin")


def build_root(home: str) -> str:
    root = settings.RAMDECK_BUILD_ROOT
    if root.startswith("~"):
        root = home.rstrip("/") + root[1:]
    return root


async def _exists(ctx, path: str) -> bool:
    argv = powershell_argv(exists_script(path)) if on_windows(ctx) else ["test", "-e", path]
    result = await ctx.transport.run(argv, timeout=30)
    return result.exit_status == 0


async def _read(ctx, path: str, nbytes: int = 1 << 20) -> str:
    return (await ctx.transport.read_head(path, nbytes)).decode("utf-8", errors="replace")


def _locked(found: dict[str, str], lock_path: str, argv: list[str]) -> list[str]:
    """argv under `flock LOCK` where flock exists (Linux); as is elsewhere."""
    return ["flock", lock_path, *argv] if found.get("flock") else argv


async def _tarball_tree(ctx, found: dict[str, str], root: str, params: dict) -> tuple[str, str, str]:
    local, sha = await tarball_to_upload(ctx, params)
    src = posixpath.join(root, src_dir_name(sha))
    for tree in (posixpath.join(src, "llama.cpp"), src):
        if await _exists(ctx, posixpath.join(tree, "CMakeLists.txt")):
            await ctx.log(f"source {src_dir_name(sha)} already unpacked on the node (cached by source hash)")
            return tree, sha, os.path.basename(local)
    remote = posixpath.join(root, "dl", os.path.basename(local))
    part = f"{remote}.{secrets.token_hex(4)}.part"
    await ctx.run(["mkdir", "-p", posixpath.join(root, "dl")], timeout=60)
    await ctx.log(f"uploading {os.path.basename(local)} ({os.path.getsize(local) // 2**20} MiB) over SFTP")
    await ctx.transport.upload(local, part)
    await ctx.run(["mv", part, remote], timeout=60)
    tmp = f"{src}.{secrets.token_hex(4)}.tmp"
    # Unpack beside the final place and move it there, so a half-unpacked tree is never taken for a cache.
    script = 'mkdir -p "$2" && tar -xzf "$1" -C "$2" --strip-components=1 && { [ -e "$3" ] || mv "$2" "$3"; }'
    argv = ["sh", "-c", script, "unpack", remote, tmp, src]
    await ctx.run(_locked(found, f"{src}.lock", argv), timeout=1800)
    await ctx.run(["rm", "-rf", tmp], timeout=300)
    tree = posixpath.join(src, "llama.cpp")
    if not await _exists(ctx, posixpath.join(tree, "CMakeLists.txt")):
        tree = src
    return tree, sha, os.path.basename(local)


async def _git_tree(ctx, found: dict[str, str], root: str, params: dict) -> tuple[str, str, str]:
    url = params.get("git_url") or settings.RAMDECK_LLAMACPP_GIT_URL
    ref = params.get("git_ref") or settings.RAMDECK_LLAMACPP_GIT_REF
    tree = posixpath.join(root, "git", "llama.cpp")
    lock = posixpath.join(root, "git.lock")
    await ctx.run(["mkdir", "-p", posixpath.join(root, "git")], timeout=60)
    if not await _exists(ctx, posixpath.join(tree, ".git")):
        await ctx.run(_locked(found, lock, ["git", "clone", "--", url, tree]), timeout=3600)
    await ctx.run(_locked(found, lock, ["git", "-C", tree, "fetch", "--tags", "--", url, ref]), timeout=3600)
    await ctx.run(
        _locked(found, lock, ["git", "-C", tree, "checkout", "--detach", "FETCH_HEAD"]), timeout=600
    )
    return tree, "", ref


async def _compile(ctx, found: dict[str, str], layout: Layout, flags: list[str], rebuild: bool) -> str:
    # Current trees keep the RPC server in tools/rpc, older ones in examples/rpc (as `rpc-server`).
    rpc_target = "ggml-rpc-server"
    for folder in ("tools", "examples"):
        cmakelists = posixpath.join(layout.tree, folder, "rpc", "CMakeLists.txt")
        if await _exists(ctx, cmakelists):
            rpc_target = rpc_target_of(await _read(ctx, cmakelists))
            break
    bins = [posixpath.join(layout.bin_dir, rpc_target), posixpath.join(layout.bin_dir, "llama-server")]
    cache_path = posixpath.join(layout.build_dir, "CMakeCache.txt")
    cached = all([await _exists(ctx, b) for b in bins]) and await _exists(ctx, cache_path)
    if cached and cache_has_flags(await _read(ctx, cache_path), flags) and not rebuild:
        await ctx.log(
            f"{layout.build_dir} already holds both binaries built with these flags: nothing to compile"
        )
        return rpc_target
    lock = f"{layout.build_dir}.lock"
    generator = ["-G", "Ninja"] if found.get("ninja") else []
    await ctx.log(f"configuring: cmake {' '.join(flags)}")
    configure = ["cmake", "-S", layout.tree, "-B", layout.build_dir, *generator, *flags]
    await ctx.run(_locked(found, lock, [*cmake_env(layout.backend, found), *configure]), timeout=1800)
    # getconf is POSIX (Linux and macOS alike); nproc is GNU's.
    cores = (await ctx.transport.run(["getconf", "_NPROCESSORS_ONLN"], timeout=30)).stdout
    jobs = cores.strip() if cores.strip().isdigit() else "2"
    build = ["cmake", "--build", layout.build_dir, "-j", jobs, "--target", rpc_target, "llama-server"]
    await ctx.log(f"building {rpc_target} and llama-server with {jobs} cores")
    await ctx.run(_locked(found, lock, build), timeout=settings.RAMDECK_COMMAND_TIMEOUT_S)
    return rpc_target


async def _check_vulkan_headers(ctx, found: dict[str, str], tree: str) -> None:
    """Refuse before compiling when the tree's Vulkan backend uses VK_EXT_layer_settings and the node's
    Vulkan headers lack it: the compile would fail half an hour in, on "'LayerSettingEXT' is not a member of
    'vk'". Older trees, which do not use it, build with older headers."""
    why = old_vulkan_headers(found, os_family(found))
    if not why:
        return
    source = posixpath.join(tree, "ggml", "src", "ggml-vulkan", "ggml-vulkan.cpp")
    uses = await ctx.transport.run(["grep", "-q", "LayerSettingEXT", source], timeout=60)
    if uses.exit_status == 0:
        raise JobFailed(f"{ctx.node.name} cannot build this llama.cpp with Vulkan: {why}.")


async def probe_binaries(ctx, bin_dir: str) -> dict:
    """Run the binaries in bin_dir: llama-server's version and the RPC server's protocol from its banner."""
    exe = ".exe" if on_windows(ctx) else ""
    rpc_binary = ""
    for name in RPC_BINARIES:
        if await _exists(ctx, join(ctx, bin_dir, name + exe)):
            rpc_binary = name
            break
    llama = join(ctx, bin_dir, "llama-server" + exe)
    if not rpc_binary or not await _exists(ctx, llama):
        raise JobFailed(f"{bin_dir} holds no ggml-rpc-server/rpc-server and llama-server pair")
    version_out = await ctx.transport.run([llama, "--version"], timeout=60)
    version = parse_server_version("\n".join(line.text for line in version_out.lines))
    if not version:
        raise JobFailed(f"{llama} --version did not print a version; is it a llama.cpp build?")
    # The banner is the only place an installed RPC server states its protocol and the devices it serves
    # with their memory: start it once on loopback and read it (detached and read from its log, the same on
    # macOS as on Linux; it waits for the whole banner, which a GPU backend prints after a second or two).
    rpc = join(ctx, bin_dir, rpc_binary + exe)
    info = parse_rpc_banner(await read_rpc_banner(ctx, rpc))
    return {
        "version": version,
        "rpc_binary": rpc_binary,
        "rpc_protocol": info["version"] or "",
        "devices": banner_devices(info),
        "rpc": rpc,
        "llama": llama,
    }


_BACKEND_PREFIXES = {"CUDA": "cuda", "ROCm": "rocm", "Vulkan": "vulkan", "MTL": "metal"}


def backend_of(devices: list[dict]) -> str:
    """The backend a build was made with, from the devices its banner lists (CUDA0 → cuda; the CPU alone
    → cpu)."""
    for device in devices:
        for prefix, backend in _BACKEND_PREFIXES.items():
            if device["name"].startswith(prefix):
                return backend
    return "cpu"


def banner_devices(info: dict) -> list[dict] | None:
    """The devices of a parsed banner as a Build stores them (printable text, cut to size); None when the
    banner lists none (an older release), so nothing is refused for want of a list."""
    if not info["devices"]:
        return None
    return [
        {
            "name": printable(d["name"], 40),
            "description": printable(d["description"], 200),
            "total_mib": d["total_mib"],
            "free_mib": d["free_mib"],
        }
        for d in info["devices"][:MAX_BANNER_DEVICES]
    ]


async def build_body(ctx) -> str:
    params = ctx.job.params or {}
    source = params.get("source", "tarball")
    if on_windows(ctx):
        return await windows_build(
            ctx, params, probe_binaries=probe_binaries, backend_of=backend_of, record=record_build
        )
    found = parse_prerequisites((await ctx.transport.run(["sh", "-c", PREREQ_SCRIPT], timeout=60)).stdout)
    kinds = await db(lambda: set(ctx.node.devices.values_list("kind", flat=True)))()
    backend = choose_backend(params.get("backend", "auto"), found, kinds)
    # The AMD GPUs' targets the probe found (rocm-smi's GFX Version): a ROCm build compiles for those only.
    targets = [t for t in (ctx.node.facts or {}).get("amdgpu_targets") or [] if isinstance(t, str)]
    missing = missing_prerequisites(found, source=source, backend=backend, gpu_targets=targets)
    if missing:
        raise JobFailed(
            f"{ctx.node.name} lacks what the {backend} build needs: {'; '.join(missing)}."
            + vulkan_instead(found, backend)
        )
    flags = cmake_flags(backend, targets)
    await ctx.log(f"prerequisites present ({found.get('os')} {found.get('arch')}); backend {backend}")
    if source != "existing":
        flags += await _amx_flags(ctx)

    if source == "existing":
        probed = await probe_binaries(ctx, params["path"])
        fields = {"source": params["path"], "build_dir": params["path"]}
    else:
        root = build_root(found.get("home", "~"))
        if source == "tarball":
            tree, sha, label = await _tarball_tree(ctx, found, root, params)
            fields = {"source": label, "tarball_sha256": sha}
        elif source == "git":
            tree, sha, ref = await _git_tree(ctx, found, root, params)
            fields = {"source": params.get("git_url") or settings.RAMDECK_LLAMACPP_GIT_URL, "ref": ref}
        else:
            raise JobFailed(f"unknown build source {source!r}")
        layout = Layout(root, tree, posixpath.join(tree, f"build-{backend}"), backend)
        if backend == "vulkan":
            await _check_vulkan_headers(ctx, found, tree)
        patched = await _lower_rpc_threshold(ctx, found, tree)
        await _compile(ctx, found, layout, flags, bool(params.get("rebuild")) or patched)
        probed = await probe_binaries(ctx, layout.bin_dir)
        header = await _read(ctx, posixpath.join(tree, "ggml", "include", "ggml-rpc.h"))
        probed["rpc_protocol"] = probed["rpc_protocol"] or parse_rpc_protocol_header(header)
        fields["build_dir"] = layout.build_dir
    if source == "existing" and probed["devices"] is not None:
        # An install the console did not build: its backend is what its rpc-server serves, not a guess.
        backend = backend_of(probed["devices"])
    return await record_build(
        ctx, probed, BuildSource(source), backend, flags if source != "existing" else [], fields
    )


async def _lower_rpc_threshold(ctx, found: dict[str, str], tree: str) -> bool:
    """RAMDeck's one change to llama.cpp's source (builds/rpc_threshold.py); True when it was made just now,
    so binaries built from the tree before it are stale."""
    argv = _locked(found, f"{tree}.lock", rpc_threshold.script_argv(tree))
    words = (await ctx.run(argv, timeout=120, echo=False)).stdout.split()
    outcome = words[-1] if words else "unknown"
    await ctx.log(rpc_threshold.outcome_message(outcome))
    return outcome == "patched"


async def _amx_flags(ctx) -> list[str]:
    """AMX left out of the build where the node's CPU lists it but faults on it (builds/amx.py)."""
    verdict = amx_verdict((await ctx.transport.run(amx_check_argv(), timeout=120)).stdout)
    if verdict == "faults":
        await ctx.log(
            "this CPU lists AMX but faults on its instructions (a virtual machine whose hypervisor does not "
            f"pass them through): building without AMX ({NO_AMX}), or llama-server would die at its first "
            "answer"
        )
    return amx_flags(verdict)


async def record_build(
    ctx, probed: dict, source_kind: str, backend: str, flags: list[str], fields: dict
) -> str:
    """The Build row for what `probe_binaries` found (on any platform), its log lines, and the hooks."""
    # The version and the protocol are what the binaries printed (an existing install's can be anything):
    # printable text only, cut to their fields, as every string a node reports.
    probed["version"] = printable(probed["version"], 200)
    probed["rpc_protocol"] = printable(probed["rpc_protocol"], 20)
    if not probed["rpc_protocol"]:
        raise JobFailed("could not tell the RPC protocol version of this build")
    build = await db(Build.objects.create)(
        node=ctx.node,
        source_kind=source_kind,
        backend=backend,
        flags=flags,
        version=probed["version"],
        rpc_binary=probed["rpc_binary"],
        rpc_protocol=probed["rpc_protocol"],
        devices=probed["devices"],
        rpc_server_path=probed["rpc"],
        llama_server_path=probed["llama"],
        job_id=ctx.job.pk,
        **fields,
    )
    await ctx.log(
        f"recorded build #{build.pk}: {probed['rpc_binary']} RPC {probed['rpc_protocol']}, "
        f"{probed['version']}"
    )
    if probed["devices"] is None:
        await ctx.log(
            "its rpc-server's banner lists no devices (an older release): plans on it are not checked"
        )
    else:
        offered = ", ".join(f"{d['name']} ({d['free_mib']} MiB free)" for d in probed["devices"])
        await ctx.log(f"its rpc-server offers {offered}; the planner may place on these and the CPU")
    for hook in AFTER_RECORDED:
        said = await db(hook)(build)
        if said:
            await ctx.log(said)
    return (
        f"llama.cpp {probed['version']} with {probed['rpc_binary']} (RPC {probed['rpc_protocol']}), {backend}"
    )
