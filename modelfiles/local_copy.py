"""A model's copies on its workers, and what they are for: filling a worker's RPC tensor cache from its own
disk before its rpc-server starts, so a first load sends the worker almost nothing (llamacpp/tensor_cache.py).

- `ensure_hashes`: the FNV-1a hash and SHA-256 of every tensor above the cache's threshold, read once from the
  model's own node (its file read in ranges over SFTP, or from the console's disk) and kept on the model;
  for a split model, each entry says which shard holds the tensor and its offset in that shard's file.
- The `model_copy` job (its node is the destination): each of the model's files streamed from its node
  through the console into `<path>.part` on the destination over SFTP, its progress (over the whole model) in
  the job log. A split model's shards go beside the first under llama.cpp's shard names
  (`NAME-0000k-of-0000N.gguf`, how llama-server finds them). A copy that stopped continues from the part's
  size; each file's SHA-256 (computed on the model's node once and kept) is checked on the destination
  before the part takes its name, and the copy is registered (`ModelCopy`, the first file's path). A file
  already at its path whose size and SHA-256 are right is kept without sending anything.
- `fill_after_copy` (the end of the copy job): every cacheable tensor of the model cut out of the copy into
  the node's cache folder, each checked by SHA-256 on the node, when the whole model fits in its cache limit:
  the first deployment then loads as a warm one, the fill off its path.
- `fill_before_start` (the rpc_server step): the cacheable tensors of the worker's blocks that are not in its
  cache (trimmed, cleared, or too large to fill whole) filled the same way before the server starts.
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
from llamacpp import gguf as gguf_profile
from llamacpp import rpc_cache, tensor_cache
from modelfiles.download import parse_sha256
from modelfiles.models import ModelCopy, ModelFile
from modelfiles.register import HEAD_FIRST_READ, HEAD_MAX_READ, file_sizes, mib
from nodes import cache
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


async def _header(transport, path: str, file_size: int) -> gguf_profile.GGUFHeader:
    """The file's GGUF header (tensor names and offsets). The model was registered from this header already,
    parsed then in a bounded child process; the parser is bounded by itself too (counts, sizes)."""
    size = HEAD_FIRST_READ
    while True:
        data = await transport.read_head(path, size)
        try:
            return await asyncio.to_thread(gguf_profile.parse_header_bytes, data, file_size=file_size)
        except gguf_profile.TruncatedHeader as exc:
            if len(data) < size or size >= HEAD_MAX_READ:
                raise
            size = min(max(size * 4, exc.needed), HEAD_MAX_READ)


async def ensure_hashes(ctx: JobContext, model: ModelFile) -> dict[str, Any]:
    """The model's tensor hashes: those on record, else read from its node once (logged) and saved. A split
    model's tensors are read from the shard that holds each."""
    paths = model.files
    if tensor_cache.valid(model.tensor_hashes, shards=len(paths)):
        return model.tensor_hashes
    node = await db(lambda: model.node)()
    async with await open_transport_for(node) as transport:
        sizes = await file_sizes(transport, paths)
        headers = []
        for path, size in zip(paths, sizes, strict=True):
            if not isinstance(size, int):
                raise JobFailed(f"{path} on {node.name} cannot be read ({size}).")
            headers.append(await _header(transport, path, size))
        todo = [(i, *t) for i, header in enumerate(headers) for t in tensor_cache.cacheable(header)]
        total = sum(n for *_, n in todo)
        where = f" in {len(paths)} shards" if len(paths) > 1 else ""
        await ctx.log(
            f"Hashing {len(todo)} tensors above the {tensor_cache.HASH_THRESHOLD // 1024} KiB cache "
            f"threshold ({mib(total)} MiB of {model.name}{where}), read from {node.name}: once per model."
        )
        tensors, done, last = [], 0, time.monotonic()
        for shard, name, offset, n in todo:
            data = await transport.read_range(paths[shard], offset, n)
            if len(data) != n:
                raise JobFailed(f"{paths[shard]} on {node.name} ends inside tensor {name}.")
            tensors.append(await asyncio.to_thread(tensor_cache.entry, name, shard, offset, data))
            done += n
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                await ctx.log(f"Hashed {mib(done)} of {mib(total)} MiB")
                last = time.monotonic()
    hashes = tensor_cache.record(tensors)
    model.tensor_hashes = hashes
    await db(model.save)(update_fields=["tensor_hashes"])
    await ctx.log(f"Hashed {len(tensors)} tensors of {model.name}.")
    return hashes


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


def copy_paths(model: ModelFile, first: str) -> list[str]:
    """Where each of the model's files lies in a copy whose first file is at `first`: a split model's other
    shards beside it under llama.cpp's shard names (`NAME-0000k-of-0000N.gguf`), which is how llama-server
    finds them from the first. Raises ValueError when `first` is not named as the first of that many."""
    if not model.is_split:
        return [first]
    count = len(model.shard_paths)
    try:
        return gguf_profile.shard_paths(first, count)
    except gguf_profile.MissingShard:
        raise ValueError(
            f"{model.name} is split into {count} files: the destination must name its first shard, "
            f"NAME-00001-of-{count:05d}.gguf, so that llama.cpp finds the others beside it."
        ) from None


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
        dests = copy_paths(model, dest)
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


# --------------------------------------------------------------------------------------------------
# Filling the cache before rpc-server starts
# --------------------------------------------------------------------------------------------------


def copy_on(model: ModelFile, node: Node) -> ModelCopy | None:
    return ModelCopy.objects.filter(model=model, node=node).first()


async def fill_before_start(ctx: JobContext, deployment) -> None:
    """When the worker holds a registered copy of the deployment's model: its cache filled from the copy with
    the cacheable tensors of the blocks the plan gives it (those the copy job filled are there already, and
    are only counted). Never stops the deployment: what is not filled is sent over the network as always, and
    the log says why."""
    model = await db(lambda: deployment.model_file)()
    copy = await db(copy_on)(model, ctx.node)
    if copy is None:
        return
    placements = [
        p
        for p in (deployment.plan or {}).get("placements", [])
        if p.get("node") == ctx.node.name and p.get("endpoint")
    ]

    def planned(hashes: dict[str, Any]) -> list[dict[str, Any]]:
        return tensor_cache.tensors_for(hashes, placements)

    await _fill_from_copy(ctx, model, copy, planned, f"the blocks planned on {ctx.node.name}")


async def fill_after_copy(ctx: JobContext, model: ModelFile, copy: ModelCopy) -> None:
    """Right after a copy is registered, in the copy's own job: the node's cache filled with every cacheable
    tensor of the model, so a deployment that places any of its blocks there finds them cached and its first
    load is as quick as a warm one (the fill, a few seconds per GiB, is off the deploy's path). Only when the
    whole model fits in the node's cache limit beside what the cache holds: otherwise each deployment fills
    the tensors of its own blocks before its rpc-server starts."""
    if not ctx.node.rpc_cache_limit_gib:
        return
    try:
        state = await cache.run_script(ctx, ctx.node, "usage")
    except JobFailed as exc:
        await ctx.log(f"WARNING: {exc}; the RPC cache is filled at each deployment instead")
        return
    room = cache.limit_bytes(ctx.node) - int(state["bytes"] or 0)

    def everything(hashes: dict[str, Any]) -> list[dict[str, Any]]:
        return [e for e in hashes["tensors"] if isinstance(e, dict)]

    await _fill_from_copy(ctx, model, copy, everything, "the whole model", room=room)


async def _fill_from_copy(ctx: JobContext, model: ModelFile, copy: ModelCopy, choose, what: str, room=None):
    """The tensors `choose(hashes)` picks cut out of the node's copy into its RPC cache (FILL_SCRIPT), each
    checked by SHA-256 on the node; one log line of what was filled. Never raises for the node's reasons."""
    try:
        try:
            paths = copy_paths(model, copy.path)
        except ValueError as exc:
            await ctx.log(f"WARNING: the RPC cache was not filled from {copy.path}: {exc}")
            return
        sizes = await file_sizes(ctx.transport, paths)
        size = sum(sizes) if all(isinstance(n, int) for n in sizes) else ", ".join(map(str, sizes))
        if size != copy.size_bytes:
            shards = f" ({len(paths)} shards)" if len(paths) > 1 else ""
            await ctx.log(
                f"WARNING: the copy of {model.name} at {copy.path}{shards} is {size} now, not "
                f"{copy.size_bytes} bytes: the RPC cache is not filled from it."
            )
            return
        hashes = await ensure_hashes(ctx, model)
        wanted = choose(hashes)
        if not wanted:
            await ctx.log(f"No tensor of {what} is above the cache threshold: nothing to fill.")
            return
        total = sum(e["size"] for e in wanted)
        free = (ctx.node.rpc_cache_state or {}).get("free_bytes")  # read by the trim or usage just before
        if free is not None and total > free:
            await ctx.log(
                f"WARNING: {ctx.node.name} has {mib(free)} MiB free on the cache's disk, the fill needs up "
                f"to {mib(total)} MiB: the RPC cache is not filled from {copy.path}."
            )
            return
        if room is not None and total > room:
            await ctx.log(
                f"The RPC cache's limit on {ctx.node.name} leaves {mib(max(room, 0))} MiB, {what} needs "
                f"{mib(total)} MiB: each deployment fills the tensors of its own blocks instead."
            )
            return
        beside = f" and the {len(paths) - 1} shards beside it" if len(paths) > 1 else ""
        await ctx.log(
            f"Filling the RPC cache from {copy.path}{beside}: {len(wanted)} tensors ({mib(total)} MiB) of "
            f"{what}, each checked by SHA-256 on the node."
        )
        began = time.monotonic()
        found: dict[str, Any] = {"have": [], "filled": [], "bad": []}
        for argv in tensor_cache.fill_argvs_shards(ctx.node.llama_cache_dir, paths, wanted):
            result = await ctx.transport.run(argv, timeout=3600)
            if not result.ok:
                why = result.stderr.strip()[:300] or f"exit status {result.exit_status}"
                await ctx.log(f"WARNING: the fill script failed on {ctx.node.name}: {why}")
                return
            part = tensor_cache.parse_fill(result.stdout)
            for key in ("have", "filled", "bad"):
                found[key] += part[key]
            found["free_bytes"] = part["free_bytes"]
        await db(cache.add_entries)(ctx.node, found["filled"], found.get("free_bytes"))
        filled = sum(n for _, n in found["filled"])
        await ctx.log(
            f"RPC cache filled in {time.monotonic() - began:.1f} s: {len(found['filled'])} tensors written "
            f"({mib(filled)} MiB), {len(found['have'])} there already, {len(found['bad'])} refused."
        )
        for name, why in found["bad"][:5]:
            await ctx.log(f"WARNING: tensor {name} not filled: {why} (it crosses the network instead)")
    except (TransportError, rpc_cache.CacheError, gguf_profile.GGUFError) as exc:
        await ctx.log(f"WARNING: the RPC cache was not filled from {copy.path}: {exc}")
    except JobFailed as exc:
        await ctx.log(f"WARNING: the RPC cache was not filled from {copy.path}: {exc.reason}")
