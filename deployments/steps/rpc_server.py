"""The `rpc_server` step: ggml-rpc-server on a worker, and in direct mode the firewall rule that admits
only the coordinator."""

from __future__ import annotations

import contextlib

from django.conf import settings
from django.utils import timezone

from deployments.steps.common import audit_step, load_deployment
from jobs.aio import db
from jobs.context import JobFailed
from jobs.on_node import flush_banner, join, on_windows, run_dir, wait_listening
from llamacpp import rpc_cache, rpc_guard
from modelfiles import cache_fill
from nodes import cache
from nodes.guards import may_administer, remove_guard
from planning import placement
from remote.powershell import firewall_add_script, is_admin_script, powershell_argv


async def rpc_server_body(ctx) -> str:
    params = ctx.job.params
    deployment = await load_deployment(ctx)
    build = await db(lambda: ctx.node.current_build)()
    if build is None:
        raise JobFailed(f"{ctx.node.name} has no llama.cpp build")
    port = int(params["port"])
    directory = await run_dir(ctx)
    # Named per deployment and node: nodes may share a home folder (NFS), and history stays readable.
    log_path = join(ctx, directory, f"d{deployment.pk}-{ctx.node.name}-rpc-server-{port}.log")
    # Weights the server has seen before are read from its disk, not sent again (llamacpp/rpc_cache.py); the
    # cache is trimmed to the node's limit first, oldest entries first (by PowerShell on Windows). A limit of
    # 0 keeps no cache.
    if ctx.node.rpc_cache_limit_gib:
        await cache.trim_before_start(ctx, ctx.node)
        # A worker holding its own copy of the model gets the weights of its blocks from its disk, not the
        # network: its cache is filled from the copy before the server starts (modelfiles/cache_fill.py; a
        # Windows node takes no copy yet, so it has none to fill from).
        if not on_windows(ctx):
            await cache_fill.fill_before_start(ctx, deployment)
    # Its threads spin briefly, then sleep, while they wait (GOMP_SPINCOUNT): see llamacpp/args.py
    # QUIET_WAIT_ENV.
    argv = rpc_cache.launch_argv(
        build.rpc_server_path,
        params["args"],
        limit_gib=ctx.node.rpc_cache_limit_gib,
        folder=ctx.node.llama_cache_dir,
        platform=ctx.node.platform,
    )
    if params.get("exposed"):
        await ctx.log(
            f"WARNING: ggml-rpc-server will listen on every interface ({params['bind']}), as an admin "
            f"set for {ctx.node.name}. It has no authentication: anyone who reaches port {port} can use it."
        )
    # Direct mode: the rule goes in before the server listens, so the port is never open to the LAN.
    fenced, guard = "", None
    if params.get("firewall"):
        fenced, guard = await install_firewall(ctx, deployment, port, params["firewall"])
    pid = None
    try:
        pid = await ctx.start_daemon(argv, log_path=log_path)
        await db(deployment.add_process)(
            f"rpc-server@{ctx.node.name}",
            {
                "node": ctx.node.name,
                "role": "rpc-server",
                "pid": pid,
                "port": port,
                "log": log_path,
                "started_at": timezone.now().isoformat(),
            },
        )
        await wait_listening(ctx, pid, port, log_path, timeout=float(params.get("listen_timeout", 30)))
        banner_text = await flush_banner(ctx, pid, _reach(params["bind"]), port, log_path)
        for line in banner_text.splitlines():
            await ctx.log(f"[rpc-server] {line}")
        problems = placement.banner_shortfalls(banner_text, params.get("needs", {}))
        if problems:
            raise JobFailed(f"{ctx.node.name}: the plan no longer fits: " + "; ".join(problems))
    except BaseException:
        if guard is not None:
            await _unfence_after_failure(ctx, pid, guard)
        raise
    return f"{build.rpc_binary} PID {pid} listening on {params['bind']}:{port}{fenced}"


def _reach(bind: str) -> str:
    """Where the node itself connects to a server bound to `bind` (every interface: its loopback)."""
    return "127.0.0.1" if rpc_guard.binds_everywhere(bind) else bind


async def _unfence_after_failure(ctx, pid: int | None, guard: dict) -> None:
    """The step failed after its firewall rule went in: end the server it started, then take the rule out
    (not the other way round: a live server behind no rule is what the rule is for). A server that does not
    end keeps its rule; the rollback's stop step tries both again (the guard stays recorded)."""
    with contextlib.suppress(Exception):
        if pid is not None and not await ctx.transport.kill(pid, grace=settings.RAMDECK_KILL_GRACE_S):
            await ctx.log(f"rpc-server PID {pid} did not end; its firewall rule stays for the rollback")
            return
        await ctx.log(f"the step failed: {await remove_guard(ctx, guard)}")


async def install_firewall(ctx, deployment, port: int, firewall: dict) -> tuple[str, dict | None]:
    """Direct mode: an iptables rule that refuses every source but the coordinator on the RPC port, where
    the SSH user may add one. Recorded as a guard first, so the stop steps remove it. Returns the note for
    the step's result and the guard (None when no rule went in)."""
    coordinator = firewall.get("coordinator")
    if on_windows(ctx) and coordinator:
        return await install_windows_firewall(ctx, deployment, port, coordinator, firewall["tag"])
    if ctx.node.platform != "linux" or not coordinator:
        why = "the coordinator has no IPv4 address" if not coordinator else "the node is not Linux"
        return await unfenced(ctx, deployment, port, why), None
    rule = rpc_guard.firewall_rule(port, coordinator, firewall["tag"])
    sudo = await may_administer(ctx, rule)
    if sudo is None:
        why = "the SSH user may not run these iptables commands through sudo -n"
        return await unfenced(ctx, deployment, port, why), None
    guard = {"node": ctx.node.name, "kind": "firewall", "rule": rule, "sudo": sudo, "tag": firewall["tag"]}
    await db(deployment.add_guard)(f"firewall@{ctx.node.name}:{port}", guard)
    result = await ctx.transport.run(rpc_guard.iptables_argv("-I", rule, sudo=sudo), timeout=60)
    if not result.ok:
        # No iptables, or no right to change it here (a container without NET_ADMIN): said loudly, as
        # when there is no sudo; tunnel mode is the way to keep the port to the coordinator there.
        why = result.stderr.strip()[:300] or "no iptables"
        return await unfenced(ctx, deployment, port, f"iptables refused the rule: {why}"), None
    await ctx.log(
        f"firewall: port {port} admits only {coordinator} ({firewall['tag']}), before ggml-rpc-server starts"
    )
    return f", admitting only {coordinator}", guard


async def install_windows_firewall(
    ctx, deployment, port: int, coordinator: str, tag: str
) -> tuple[str, dict | None]:
    """Windows: two Windows Firewall rules (block all but the coordinator, allow the coordinator), where the
    SSH login is an administrator. Recorded as a guard first, so the stop steps remove them."""
    admin = await ctx.transport.run(powershell_argv(is_admin_script()), timeout=60)
    if admin.stdout.strip() != "True":
        why = "the SSH user is not an administrator of this Windows PC, so it may not change Windows Firewall"
        return await unfenced(ctx, deployment, port, why), None
    guard = {"node": ctx.node.name, "kind": "windows-firewall", "tag": tag}
    await db(deployment.add_guard)(f"firewall@{ctx.node.name}:{port}", guard)
    result = await ctx.transport.run(powershell_argv(firewall_add_script(port, coordinator, tag)), timeout=60)
    if not result.ok:
        why = "; ".join(line.text for line in result.lines[-3:] if line.text)[:300] or "no reason given"
        return await unfenced(ctx, deployment, port, f"New-NetFirewallRule failed: {why}"), None
    await ctx.log(f"firewall: port {port} admits only {coordinator} ({tag}), before ggml-rpc-server starts")
    return f", admitting only {coordinator}", guard


async def unfenced(ctx, deployment, port: int, why: str) -> str:
    """Direct mode without a firewall rule: said in the log and in the audit history, and the run goes on
    (the operator chose direct mode; tunnel mode is what keeps the port to the coordinator there)."""
    await ctx.log(
        f"WARNING: no firewall rule on {ctx.node.name} ({why}): port {port} is open to the whole network. "
        "Tunnel mode keeps it to the coordinator."
    )
    await db(audit_step)(
        ctx.job, "deployment.rpc_unfenced", deployment, {"node": ctx.node.name, "port": port, "why": why}
    )
    return f" (no firewall rule: {why})"
