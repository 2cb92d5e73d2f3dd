"""The source tarballs a build may use: the console's tarball folder, what it offers, and the pinned
llama.cpp source fetched into it on first use."""

from __future__ import annotations

import os

from asgiref.sync import sync_to_async
from django.conf import settings

from jobs.context import JobFailed
from llamacpp.source import PINNED, FetchFailed, fetch_pinned_tarball, file_sha256

TARBALL_SUFFIXES = (".tar.gz", ".tgz")


def tarball_dir() -> str:
    return os.path.realpath(os.path.expanduser(settings.RAMDECK_TARBALL_DIR))


def allowed_tarball(path: str) -> str | None:
    """The real path of `path` when it is a tarball file inside RAMDECK_TARBALL_DIR, else None. Only those
    files may be uploaded to a node: an operator must not be able to copy any file of the console host."""
    if not path:
        return None
    real = os.path.realpath(os.path.expanduser(path))
    inside = os.path.commonpath([real, tarball_dir()]) == tarball_dir()
    if not inside or not os.path.isfile(real) or not real.endswith(TARBALL_SUFFIXES):
        return None
    return real


def offered_tarballs() -> list[str]:
    """Names of the tarballs in RAMDECK_TARBALL_DIR (symlinks leading outside it are not offered), the pinned
    llama.cpp source first: it is always offered, since a build fetches it when it is not there yet."""
    try:
        names = sorted(os.listdir(tarball_dir()))
    except OSError:
        names = []
    present = [n for n in names if n != PINNED.filename and allowed_tarball(os.path.join(tarball_dir(), n))]
    return [PINNED.filename, *present]


def pinned_tarball_path() -> str:
    return os.path.join(tarball_dir(), PINNED.filename)


async def ensure_pinned_tarball(ctx) -> str:
    """Fetch the pinned llama.cpp source into the tarball folder on the console's host, once."""
    path = pinned_tarball_path()
    if os.path.isfile(path):
        return path
    await ctx.log(f"the pinned llama.cpp source is not on this console yet: fetching {PINNED.requirement}")
    try:
        fetched = await sync_to_async(fetch_pinned_tarball, thread_sensitive=False)(tarball_dir(), log=_quiet)
    except (FetchFailed, OSError) as exc:
        raise JobFailed(f"could not fetch the llama.cpp source: {exc}") from exc
    await ctx.log(f"fetched {PINNED.filename} (SHA-256 {PINNED.sha256[:16]}… checked)")
    return str(fetched)


def _quiet(_message: str) -> None:
    """The fetch's own progress messages: the job logs its own lines instead."""


async def tarball_to_upload(ctx, params: dict) -> tuple[str, str]:
    """The build's tarball on the console (fetched first when it is the pinned one) and its SHA-256, or a
    refusal when it lies outside the only folder builds may upload from. POSIX and Windows builds alike."""
    if params.get("tarball") == pinned_tarball_path():
        await ensure_pinned_tarball(ctx)
    local = allowed_tarball(params.get("tarball") or "")
    if local is None:
        raise JobFailed(
            f"{params.get('tarball')!r} is not a tarball in {settings.RAMDECK_TARBALL_DIR}, "
            "the only folder builds may upload from"
        )
    return local, params.get("tarball_sha256") or await sync_to_async(file_sha256)(local)
