"""A node's ggml-rpc-server tensor cache, as the console manages it: read its size and free disk, trim it to
the node's limit (oldest entries first, before a deployment starts an rpc-server there), clear it.

Every look goes through llamacpp.rpc_cache's one script over the node's transport (sh, or PowerShell on a
Windows node: both print the same lines); what it found is saved on the node (`rpc_cache_state`) for its
page. The `rpc_cache` job kind runs "usage" and "clear"."""

from __future__ import annotations

from django.utils import timezone

from jobs.aio import db
from jobs.context import JobFailed
from jobs.models import Job
from jobs.on_node import on_windows
from llamacpp import rpc_cache
from nodes.models import Node
from remote.powershell import NotForWindows
from remote.text import printable

KIND = "rpc_cache"
GIB = rpc_cache.GIB


def users_of(node: Node) -> list[str]:
    """The active deployments holding something on `node` (their claims), by name: why Clear is refused."""
    names = node.claims.active().values_list("deployment__name", flat=True).distinct()
    return sorted(str(n) for n in names)


def refusal(node: Node) -> str:
    """Why the cache of `node` may not be cleared now, or "" when it may."""
    users = users_of(node)
    if not users:
        return ""
    return (
        f"{node.name}'s RPC cache is in use by deployment {', '.join(users)}: stop it first "
        "(its rpc-server reads the cache while it loads)."
    )


def limit_bytes(node: Node) -> int:
    return int(node.rpc_cache_limit_gib) * GIB


def add_entries(node: Node, filled: list[tuple[str, int]], free_bytes: int | None) -> None:
    """Entries written into the cache since it was read (a fill from a local copy): counted on the node."""
    state = dict(node.rpc_cache_state or {})
    names = list(state.get("names") or [])
    new = [(name, size) for name, size in filled if name not in set(names)]
    state["names"] = (names + [name for name, _ in new])[: rpc_cache.MAX_NAMES]
    state["entries"] = int(state.get("entries") or 0) + len(new)
    state["bytes"] = int(state.get("bytes") or 0) + sum(size for _, size in new)
    if free_bytes is not None:
        state["free_bytes"] = free_bytes
    node.rpc_cache_state = state
    node.save(update_fields=["rpc_cache_state"])


def save_state(node: Node, found: dict) -> None:
    state = {key: found[key] for key in ("dir", "entries", "bytes", "free_bytes", "names")}
    state["read_at"] = timezone.now().isoformat()
    node.rpc_cache_state = state
    node.save(update_fields=["rpc_cache_state"])


async def run_script(ctx, node: Node, action: str, limit: int = 0) -> dict:
    """Run the cache script for `action` on the node, log what it did in one or two lines, save the state."""
    # The transport's shell, found when it connected, says which script the node runs.
    try:
        argv = rpc_cache.script_argv(action, node.llama_cache_dir, limit, windows=on_windows(ctx))
    except (rpc_cache.CacheError, NotForWindows) as exc:  # a folder of the other platform's form
        raise JobFailed(f"the RPC cache of {node.name}: {exc}") from exc
    result = await ctx.transport.run(argv, timeout=300)
    if not result.ok:
        err = "\n".join(line.text for line in result.lines if line.stream == "err")
        why = err.strip()[:300] or f"exit status {result.exit_status}"
        raise JobFailed(f"the RPC cache script failed on {node.name}: {why}")
    found = rpc_cache.parse(result.stdout)
    found["dir"] = printable(
        found["dir"], 500
    )  # the node's words: cleaned where stored, as every probe field
    if found["bytes"] is None:
        raise JobFailed(f"the RPC cache script printed no size on {node.name}")
    removed = found["removed"]
    if removed:
        freed = sum(size for _, size in removed)
        await ctx.log(f"RPC cache: removed {len(removed)} entries ({_mib(freed)}), oldest first")
    free = f", {_gib(found['free_bytes'])} free on its disk" if found["free_bytes"] is not None else ""
    await ctx.log(f"RPC cache {found['dir']}: {found['entries']} entries, {_mib(found['bytes'])}{free}")
    await db(save_state)(node, found)
    return found


async def trim_before_start(ctx, node: Node) -> None:
    """Before an rpc-server starts with its cache: the cache trimmed to the node's limit, oldest first. A
    cache that cannot be read does not stop the deployment (the server still starts; the log says why)."""
    try:
        await run_script(ctx, node, "trim", limit_bytes(node))
    except JobFailed as exc:
        await ctx.log(f"WARNING: {exc}; the RPC cache was not trimmed")


async def rpc_cache_body(ctx) -> str:
    """The `rpc_cache` job: params {"action": "usage" | "clear"}."""
    node = ctx.node
    action = ctx.job.params.get("action", "usage")
    if action not in ("usage", "clear"):
        raise JobFailed(f"unknown RPC cache action {action!r}")
    if action == "clear":
        # Checked again here: a deployment may have started between the button and the job.
        why = await db(refusal)(node)
        if why:
            raise JobFailed(why)
    found = await run_script(ctx, node, action)
    if action == "clear":
        freed = sum(size for _, size in found["removed"])
        return f"cleared {len(found['removed'])} entries ({_mib(freed)}) from {found['dir']}"
    return f"{found['entries']} entries, {_mib(found['bytes'])} in {found['dir']}"


def start(node: Node, action: str, user) -> Job:
    """Queue an `rpc_cache` job on `node` (enqueued when the transaction commits)."""
    titles = {"usage": "Read the RPC cache", "clear": "Clear the RPC cache"}
    job = Job.objects.create(
        kind=KIND, node=node, title=titles[action], params={"action": action}, created_by=user
    )
    job.enqueue()
    return job


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 1024**2:.1f} MiB"


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f} GiB"
