"""A model's copies on its workers: the `model_copy` job and what the pages offer of it. A copy is what fills
a worker's RPC tensor cache from its own disk, so a first load sends the worker almost nothing; the hashing of
the model's tensors and the fills themselves are modelfiles/cache_fill.py's.

The `model_copy` job (its node is the destination): each of the model's files streamed from its node through
the console into `<path>.part` on the destination over SFTP, its progress (over the whole model) in the job
log. A split model's shards go beside the first under llama.cpp's shard names (`NAME-0000k-of-0000N.gguf`,
how llama-server finds them). A copy that stopped continues from the part's size; each file's SHA-256
(computed on the model's node once and kept) is checked on the destination before the part takes its name,
and the copy is registered (`ModelCopy`, the first file's path). A file already at its path whose size and
SHA-256 are right is kept without sending anything. The job ends by filling the node's cache from the copy
(cache_fill.fill_after_copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit import history
from jobs.aio import db, open_transport_for
from jobs.context import JobFailed
from jobs.models import Job
from modelfiles.cache_fill import ensure_hashes, fill_after_copy
from modelfiles.download import parse_sha256
from modelfiles.models import ModelCopy, ModelFile
from modelfiles.register import file_sizes, mib
from remote.base import TransportError

if TYPE_CHECKING:
    from jobs.context import JobContext
    from nodes.models import Node

KIND = "model_copy"
# The copy moves this much per SFTP write (and reads it from the source in one request).
CHUNK = 8 * 2**20
PROGRESS_EVERY_S = 3.0
_SHA_SCRIPT = (
    'if command -v sha256sum >/dev/null 2>&1; then sha256sum -- "$1"; else shasum -a 256 -- "$1"; fi'
)


# --------------------------------------------------------------------------------------------------
# Reading the model on its node
# --------------------------------------------------------------------------------------------------


async def _sha256_on(transport, path: str) -> str | None:
    result = await transport.run(["sh", "-c", _SHA_SCRIPT, "sh", path], timeout=3600)
    return parse_sha256(result.stdout) if result.ok else None


async def ensure_sha256(ctx: JobContext, model: ModelFile) -> str:
    """The model file's SHA-256: on record, else computed on its own node (and saved)."""
    if model.sha256:
        return model.sha256
    node = await db(lambda: model.node)()
    await ctx.log(f"Computing the SHA-256 of {model.path} on {node.name} (once per model).")
    async with await open_transport_for(node) as transport:
        sha = await _sha256_on(transport, model.path)
    if not sha:
        raise JobFailed(f"Could not compute the SHA-256 of {model.path} on {node.name}.")
    model.sha256 = sha
    await db(model.save)(update_fields=["sha256"])
    return sha


async def ensure_shard_sha256(ctx: JobContext, model: ModelFile) -> list[str]:
    """The SHA-256 of each of the model's files, in order: a single file's is `ensure_sha256`'s; a split
    model's shards are each computed on its own node once, and kept as each is done (a job stopped halfway
    through a large model does not compute the finished ones again)."""
    if not model.is_split:
        return [await ensure_sha256(ctx, model)]
    paths = model.files
    shas = list(model.shard_sha256 or [])[: len(paths)]
    if len(shas) == len(paths):
        return shas
    if not shas and model.sha256:
        shas = [model.sha256]  # The first file's, checked by its download.
    node = await db(lambda: model.node)()
    await ctx.log(
        f"Computing the SHA-256 of the {len(paths)} shards of {model.name} on {node.name} (once per model)."
    )
    async with await open_transport_for(node) as transport:
        for path in paths[len(shas) :]:
            sha = await _sha256_on(transport, path)
            if not sha:
                raise JobFailed(f"Could not compute the SHA-256 of {path} on {node.name}.")
            shas.append(sha)
            model.shard_sha256, model.sha256 = list(shas), shas[0]
            await db(model.save)(update_fields=["shard_sha256", "sha256"])
    return shas


# --------------------------------------------------------------------------------------------------
# The copy job
# --------------------------------------------------------------------------------------------------


def default_destination(model: ModelFile) -> str:
    """Where a copy goes unless the operator names a path: the nodes' model folder, the file's own name."""
    return posixpath.join(settings.RAMDECK_NODE_MODEL_DIR, posixpath.basename(model.path))


def check_destination(path: str) -> str:
    """A destination path the job may write: absolute (or under ~), printable, a .gguf file name."""
    path = path.strip()
    if not (path.startswith("/") or path.startswith("~/")):
        raise ValueError("The destination must be an absolute path (or start with ~/).")
    if any(ord(c) < 32 or ord(c) == 127 for c in path):
        raise ValueError("The destination contains a control character.")
    if "/../" in f"{path}/" or not path.lower().endswith(".gguf"):
        raise ValueError("The destination must be a .gguf file's path, without '..'.")
    return posixpath.normpath(path)


def pays(model: ModelFile, node: Node) -> dict[str, Any]:
    """What a copy costs against streaming: the bytes a cold start sends `node` for the plans it held blocks
    in (the largest share seen), and the copy's one transfer of the whole file. `starts` is how many cold
    starts (a cache cleared or trimmed, a new split, another worker's share) the copy is worth."""
    streamed = 0
    for deployment in model.deployments.all():
        share = sum(
            int(p.get("weights_bytes") or 0)
            for p in (deployment.plan or {}).get("placements", [])
            if p.get("node") == node.name and p.get("endpoint")
        )
        streamed = max(streamed, share)
    size = int(model.size_bytes or 0)
    starts = -(-size // streamed) if streamed else None
    return {"streamed_bytes": streamed, "copy_bytes": size, "starts": starts}


def offer(model: ModelFile, node: Node) -> dict[str, Any] | None:
    """A copy of `model` to `node` as the node page and the model page offer it, with what it pays against
    streaming; None where the job would refuse it: a Windows node (no copy, nor a fill of its RPC cache from
    one, yet), the model's own node. Whether the node holds a copy already is the caller's query."""
    if node.platform == "windows" or model.node_id == node.pk:
        return None
    return {"model": model, "node": node, **pays(model, node)}


def start_copy(model: ModelFile, node: Node, path: str, user) -> Job:
    """Queue a `model_copy` job onto `node` (enqueued when the transaction commits)."""
    job = Job.objects.create(
        kind=KIND,
        node=node,
        title=f"Copy {model.name} to {node.name}"[:200],
        params={"model": model.pk, "path": path},
        created_by=user,
    )
    job.enqueue()
    return job


async def _resolve_home(ctx: JobContext, path: str) -> str:
    if not path.startswith("~"):
        return path
    home = (await ctx.transport.run(["sh", "-c", 'printf %s "$HOME"'], timeout=30)).stdout.strip()
    if not home.startswith("/"):
        raise JobFailed(f"Could not find the home folder of the console's user on {ctx.node.name}.")
    return home.rstrip("/") + path[1:]


def _register(job: Job, model: ModelFile, path: str, size: int, sha: str) -> ModelCopy:
    with transaction.atomic():
        copy, _ = ModelCopy.objects.update_or_create(
            model=model,
            node=job.node,
            defaults={"path": path, "size_bytes": size, "sha256": sha, "verified_at": timezone.now()},
        )
        history.record(
            job.created_by,
            "model.copy.registered",
            model,
            changes={"node": job.node.name, "path": path, "sha256": sha, "job": job.pk},
        )
    return copy


@dataclass(frozen=True)
class _File:
    """One of the model's files as the copy moves it: from `source` on the model's node to `dest`."""

    source: str
    dest: str
    size: int
    sha256: str
    # How the log names it: "the copy" for a single-file model, "shard 2 of 3" for a split one.
    label: str


async def _files(ctx: JobContext, model: ModelFile, dest: str) -> list[_File]:
    """Each of the model's files with its destination (the first at `dest`), size and SHA-256."""
    try:
        dests = model.copy_paths(dest)
    except ValueError as exc:
        raise JobFailed(str(exc)) from None
    shas = await ensure_shard_sha256(ctx, model)
    if not model.is_split:
        return [_File(model.path, dest, int(model.size_bytes), shas[0], "the copy")]
    async with await open_transport_for(model.node) as source:
        sizes = await file_sizes(source, model.files)
    if not all(isinstance(n, int) for n in sizes) or sum(sizes) != model.size_bytes:
        raise JobFailed(
            f"The shards of {model.name} on {model.node.name} are not the files registered "
            f"({', '.join(map(str, sizes))}; {model.size_bytes} bytes in all were): register the model again."
        )
    count = len(dests)
    return [
        _File(source, path, size, sha, f"shard {i} of {count}")
        for i, (source, path, size, sha) in enumerate(zip(model.files, dests, sizes, shas, strict=True), 1)
    ]


async def model_copy_body(ctx: JobContext) -> str:
    """Params {"model": pk, "path": destination on the job's node (a split model's first shard)}."""
    params = ctx.job.params
    model = await db(lambda: ModelFile.objects.select_related("node").filter(pk=params["model"]).first())()
    if model is None:
        raise JobFailed("The model no longer exists.")
    if ctx.node.platform == "windows":
        raise JobFailed(f"{ctx.node.name} runs Windows, where copying a model is not built yet.")
    if model.node_id == ctx.node.pk:
        raise JobFailed(f"{model.name} lives on {ctx.node.name} already.")
    dest = await _resolve_home(ctx, params["path"])
    files = await _files(ctx, model, dest)
    states = await file_sizes(ctx.transport, [f.dest for f in files])
    todo = []
    # Every file is looked at before anything is sent: a path that holds something else stops the job
    # before it writes a byte.
    for f, state in zip(files, states, strict=True):
        what = model.name if len(files) == 1 else f"{f.label} of {model.name}"
        if state == f.size and await _sha256_on(ctx.transport, f.dest) == f.sha256:
            await ctx.log(f"{f.dest} on {ctx.node.name} already holds {what} (size and SHA-256 checked).")
        elif state != "missing":
            raise JobFailed(f"{f.dest} exists on {ctx.node.name} and is not {what}: choose another path.")
        else:
            todo.append(f)
    if todo:
        await _copy(ctx, model, todo, int(model.size_bytes))
    copy = await db(_register)(ctx.job, model, dest, int(model.size_bytes), files[0].sha256)
    await ensure_hashes(ctx, model)
    await fill_after_copy(ctx, model, copy)
    beside = f" (and its other {len(files) - 1} shards beside it)" if len(files) > 1 else ""
    return f"{model.name} is on {ctx.node.name} at {dest}{beside}: its RPC cache is filled from it."


class _Progress:
    """The copy's progress over the whole model (files already there count as copied), logged every few
    seconds and at the end, with the rate of this job's own transfer."""

    def __init__(self, ctx: JobContext, size: int, done: int):
        self.ctx, self.size, self.done, self.first = ctx, size, done, done
        self.begun, self.last = time.monotonic(), 0.0

    async def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S or self.done == self.size:
            rate = (self.done - self.first) / max(now - self.begun, 1e-6) / 2**20
            await self.ctx.log(
                f"Copied {mib(self.done)} of {mib(self.size)} MiB ({self.done * 100 // self.size}%, "
                f"{rate:.1f} MiB/s)"
            )
            self.last = now


async def _copy(ctx: JobContext, model: ModelFile, todo: list[_File], size: int) -> None:
    """The files in `todo` streamed from the model's node one after the other, each resumed from its part
    and checked before it takes its name."""
    await ctx.run(["mkdir", "-p", "--", posixpath.dirname(todo[0].dest)])
    parts = await file_sizes(ctx.transport, [f.dest + ".part" for f in todo])
    starts = [n if isinstance(n, int) and n <= f.size else 0 for f, n in zip(todo, parts, strict=True)]
    for f, start in zip(todo, starts, strict=True):
        if start:
            await ctx.log(
                f"Resuming {f.label} at {mib(start)} of {mib(f.size)} MiB ({f.dest}.part was left by an "
                "earlier one)."
            )
    left = sum(f.size - start for f, start in zip(todo, starts, strict=True))
    if model.is_split:
        await ctx.log(
            f"Copying {mib(left)} MiB of {model.name} ({len(todo)} of {len(model.shard_paths)} shards) from "
            f"{model.node.name} to {ctx.node.name}:{posixpath.dirname(todo[0].dest)}"
        )
    elif not starts[0]:
        await ctx.log(
            f"Copying {mib(size)} MiB of {model.name} from {model.node.name} to "
            f"{ctx.node.name}:{todo[0].dest}"
        )
    progress = _Progress(ctx, size, size - left)
    source = await open_transport_for(model.node)
    try:
        async with source:
            for f, start in zip(todo, starts, strict=True):
                await _send(ctx, source, model, f, start, progress)
                await _check_and_place(ctx, f)
    except TransportError as exc:
        raise JobFailed(
            f"The copy stopped at {mib(progress.done)} MiB: {exc}. Start it again to continue."
        ) from None


async def _send(ctx: JobContext, source, model: ModelFile, f: _File, start: int, progress: _Progress) -> None:
    """One file streamed into `<dest>.part` from byte `start`."""
    part = f.dest + ".part"

    def read(offset: int) -> asyncio.Task[bytes] | None:
        if offset >= f.size:
            return None
        return asyncio.ensure_future(source.read_range(f.source, offset, min(CHUNK, f.size - offset)))

    done = start
    pending: asyncio.Task[bytes] | None = None
    try:
        # The next chunk is read from the source while this one is written to the node: the two links
        # (source to console, console to node) work at once.
        pending = read(done)
        while pending is not None:
            if ctx.cancelled():
                raise JobFailed(f"Cancelled at {mib(progress.done)} MiB; a new copy continues from there.")
            data = await pending
            pending = None
            if not data:
                raise JobFailed(f"{f.source} on {model.node.name} ended at {done} bytes, not {f.size}.")
            pending = read(done + len(data))
            await ctx.transport.write_at(part, done, data)
            done += len(data)
            await progress.add(len(data))
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending


async def _check_and_place(ctx: JobContext, f: _File) -> None:
    """The part's SHA-256 checked on the node: a right one takes its name, a wrong one is removed."""
    part = f.dest + ".part"
    await ctx.log(f"Checking the SHA-256 of {f.label} on the node.")
    got = await _sha256_on(ctx.transport, part)
    if got != f.sha256:
        await ctx.run(["rm", "-f", "--", part])
        raise JobFailed(
            f"The SHA-256 of {f.label} is {got}, not the model's {f.sha256}: removed it; start again."
        )
    await ctx.run(["mv", "-f", "--", part, f.dest])
