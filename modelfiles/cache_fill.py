"""A worker's RPC tensor cache filled from its own copy of a model, so a first load sends the worker almost
nothing (llamacpp/tensor_cache.py); the copies themselves are made by the `model_copy` job
(modelfiles/local_copy.py).

- `ensure_hashes`: the FNV-1a hash and SHA-256 of every tensor above the cache's threshold, read once from the
  model's own node (its file read in ranges over SFTP, or from the console's disk) and kept on the model;
  for a split model, each entry says which shard holds the tensor and its offset in that shard's file.
- `fill_after_copy` (the end of the copy job): every cacheable tensor of the model cut out of the copy into
  the node's cache folder, each checked by SHA-256 on the node, when the whole model fits in its cache limit:
  the first deployment then loads as a warm one, the fill off its path.
- `fill_before_start` (the rpc_server step): the cacheable tensors of the worker's blocks that are not in its
  cache (trimmed, cleared, or too large to fill whole) filled the same way before the server starts.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from jobs.aio import db, open_transport_for
from jobs.context import JobFailed
from llamacpp import gguf as gguf_profile
from llamacpp import rpc_cache, tensor_cache
from modelfiles.models import ModelCopy, ModelFile
from modelfiles.register import HEAD_FIRST_READ, HEAD_MAX_READ, file_sizes, mib
from nodes import cache
from remote.base import TransportError

if TYPE_CHECKING:
    from jobs.context import JobContext
    from nodes.models import Node

PROGRESS_EVERY_S = 3.0


# --------------------------------------------------------------------------------------------------
# Hashing the model's tensors on its node
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
            paths = model.copy_paths(copy.path)
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
