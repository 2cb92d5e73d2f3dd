"""A model's copies on its workers, and what they are for: filling a worker's RPC tensor cache from its own
disk before its rpc-server starts, so a first load sends the worker almost nothing (llamacpp/tensor_cache.py).

- `ensure_hashes`: the FNV-1a hash and SHA-256 of every tensor above the cache's threshold, read once from the
  model's own node (its file read in ranges over SFTP, or from the console's disk) and kept on the model.
- The `model_copy` job (its node is the destination): the model's file streamed from its node through the
  console into `<path>.part` on the destination over SFTP, its progress in the job log. A copy that stopped
  continues from the part's size; the whole file's SHA-256 is checked on the destination before the part
  takes its name, and the copy is registered (`ModelCopy`). A file already at the path whose size and
  SHA-256 are the model's is registered without sending anything.
- `fill_after_copy` (the end of the copy job): every cacheable tensor of the model cut out of the copy into
  the node's cache folder, each checked by SHA-256 on the node, when the whole model fits in its cache limit:
  the first deployment then loads as a warm one, the fill off its path.
- `fill_before_start` (the rpc_server step): the cacheable tensors of the worker's blocks that are not in its
  cache (trimmed, cleared, or too large to fill whole) filled the same way before the server starts.

Split models (several shards) are not copied yet: the job refuses them, saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import posixpath
import time
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


def _entry(name: str, offset: int, data: bytes) -> dict[str, Any]:
    return {
        "name": name,
        "offset": offset,
        "size": len(data),
        "fnv": tensor_cache.fnv1a_64(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


async def ensure_hashes(ctx: JobContext, model: ModelFile) -> dict[str, Any]:
    """The model's tensor hashes: those on record, else read from its node once (logged) and saved."""
    if tensor_cache.valid(model.tensor_hashes):
        return model.tensor_hashes
    if model.is_split:
        raise JobFailed(f"{model.name} is a split model ({len(model.shard_paths)} files): not supported yet.")
    node = await db(lambda: model.node)()
    async with await open_transport_for(node) as transport:
        [size] = await file_sizes(transport, [model.path])
        if not isinstance(size, int):
            raise JobFailed(f"{model.path} on {node.name} cannot be read ({size}).")
        header = await _header(transport, model.path, size)
        todo = tensor_cache.cacheable(header)
        total = sum(n for _, _, n in todo)
        await ctx.log(
            f"Hashing {len(todo)} tensors above the {tensor_cache.HASH_THRESHOLD // 1024} KiB cache "
            f"threshold ({mib(total)} MiB of {model.name}), read from {node.name}: once per model."
        )
        tensors, done, last = [], 0, time.monotonic()
        for name, offset, n in todo:
            data = await transport.read_range(model.path, offset, n)
            if len(data) != n:
                raise JobFailed(f"{model.path} on {node.name} ends inside tensor {name}.")
            tensors.append(await asyncio.to_thread(_entry, name, offset, data))
            done += n
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                await ctx.log(f"Hashed {mib(done)} of {mib(total)} MiB")
                last = time.monotonic()
    hashes = {"version": tensor_cache.VERSION, "threshold": tensor_cache.HASH_THRESHOLD, "tensors": tensors}
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
    streaming; None where the job would refuse it: a split model, a Windows node (no copy, nor a fill of
    its RPC cache from one, yet), the model's own node. Whether the node holds a copy already is the caller's
    query."""
    if model.is_split or node.platform == "windows" or model.node_id == node.pk:
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


async def model_copy_body(ctx: JobContext) -> str:
    """Params {"model": pk, "path": destination on the job's node}."""
    params = ctx.job.params
    model = await db(lambda: ModelFile.objects.select_related("node").filter(pk=params["model"]).first())()
    if model is None:
        raise JobFailed("The model no longer exists.")
    if ctx.node.platform == "windows":
        raise JobFailed(f"{ctx.node.name} runs Windows, where copying a model is not built yet.")
    if model.is_split:
        raise JobFailed(f"{model.name} is a split model: copying split models is not supported yet.")
    if model.node_id == ctx.node.pk:
        raise JobFailed(f"{model.name} lives on {ctx.node.name} already.")
    dest = await _resolve_home(ctx, params["path"])
    sha = await ensure_sha256(ctx, model)
    size = int(model.size_bytes)
    [state] = await file_sizes(ctx.transport, [dest])
    if state == size and await _sha256_on(ctx.transport, dest) == sha:
        await ctx.log(f"{dest} on {ctx.node.name} already holds {model.name} (size and SHA-256 checked).")
    else:
        if state != "missing":
            raise JobFailed(f"{dest} exists on {ctx.node.name} and is not {model.name}: choose another path.")
        await _copy(ctx, model, dest, size, sha)
    copy = await db(_register)(ctx.job, model, dest, size, sha)
    await ensure_hashes(ctx, model)
    await fill_after_copy(ctx, model, copy)
    return f"{model.name} is on {ctx.node.name} at {dest}: its RPC cache is filled from it."


async def _copy(ctx: JobContext, model: ModelFile, dest: str, size: int, sha: str) -> None:
    part = dest + ".part"
    await ctx.run(["mkdir", "-p", "--", posixpath.dirname(dest)])
    [have] = await file_sizes(ctx.transport, [part])
    start = have if isinstance(have, int) and have <= size else 0
    if start:
        await ctx.log(
            f"Resuming the copy at {mib(start)} of {mib(size)} MiB ({part} was left by an earlier one)."
        )
    else:
        await ctx.log(
            f"Copying {mib(size)} MiB of {model.name} from {model.node.name} to {ctx.node.name}:{dest}"
        )
    source = await open_transport_for(model.node)
    begun, last, done = time.monotonic(), 0.0, start

    def read(offset: int) -> asyncio.Task[bytes] | None:
        if offset >= size:
            return None
        return asyncio.ensure_future(source.read_range(model.path, offset, min(CHUNK, size - offset)))

    pending: asyncio.Task[bytes] | None = None
    try:
        async with source:
            # The next chunk is read from the source while this one is written to the node: the two links
            # (source to console, console to node) work at once.
            pending = read(done)
            while pending is not None:
                if ctx.cancelled():
                    raise JobFailed(f"Cancelled at {mib(done)} MiB; a new copy continues from there.")
                data = await pending
                pending = None
                if not data:
                    raise JobFailed(f"{model.path} on {model.node.name} ended at {done} bytes, not {size}.")
                pending = read(done + len(data))
                await ctx.transport.write_at(part, done, data)
                done += len(data)
                now = time.monotonic()
                if now - last >= PROGRESS_EVERY_S or done == size:
                    rate = (done - start) / max(now - begun, 1e-6) / 2**20
                    await ctx.log(
                        f"Copied {mib(done)} of {mib(size)} MiB ({done * 100 // size}%, {rate:.1f} MiB/s)"
                    )
                    last = now
    except TransportError as exc:
        raise JobFailed(f"The copy stopped at {mib(done)} MiB: {exc}. Start it again to continue.") from None
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
    await ctx.log("Checking the copy's SHA-256 on the node.")
    got = await _sha256_on(ctx.transport, part)
    if got != sha:
        await ctx.run(["rm", "-f", "--", part])
        raise JobFailed(f"The copy's SHA-256 is {got}, not the model's {sha}: removed it; start again.")
    await ctx.run(["mv", "-f", "--", part, dest])


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
        [size] = await file_sizes(ctx.transport, [copy.path])
        if size != copy.size_bytes:
            await ctx.log(
                f"WARNING: the copy of {model.name} at {copy.path} is {size} now, not "
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
        await ctx.log(
            f"Filling the RPC cache from {copy.path}: {len(wanted)} tensors ({mib(total)} MiB) of {what}, "
            "each checked by SHA-256 on the node."
        )
        began = time.monotonic()
        found: dict[str, Any] = {"have": [], "filled": [], "bad": []}
        for argv in tensor_cache.fill_argvs(ctx.node.llama_cache_dir, copy.path, wanted):
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
