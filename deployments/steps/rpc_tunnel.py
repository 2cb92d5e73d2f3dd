"""The `rpc_tunnel` step: the coordinator's SSH local forward to one worker's ggml-rpc-server.

Runs on the coordinator (its transport is ctx.transport) after the worker's rpc-server listens on
127.0.0.1. It generates a key pair for this deployment and worker, writes the private half and the worker's
pinned host key on the coordinator (0600, in ~/.ramdeck/run, straight from memory), installs the public
half on the worker (over the console's own SSH connection to it) restricted to that one forward from the
address the worker sees the coordinator come from (learnt by one login first, see install_key), says
whether the worker's sshd would let the key make Unix-socket forwards as well (no key option can refuse
those), and starts `ssh -tt -L` on the coordinator on a free loopback port that the deployment claims. The
forward is recorded as a process of the deployment (role "rpc-tunnel"), the authorized_keys lines as a
guard: the stop steps end the one and remove exactly the other (deployments/steps/llama_server.py). See
llamacpp/rpc_guard.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from deployments.models import ResourceClaim
from deployments.steps.common import audit_step, load_deployment
from jobs.aio import db
from jobs.context import JobFailed
from jobs.on_node import run_dir, tail_lines, write_secret_file
from llamacpp import rpc_guard
from llamacpp.reaper import find_holders
from nodes.models import Node
from nodes.transports import transport_for
from remote.base import TransportError

# How many loopback ports the step tries on the coordinator before it gives up.
PORT_ATTEMPTS = 20


def _worker(pk: int):
    return Node.objects.select_related("credential").get(pk=pk)


def authorized_keys_path(node, home: str) -> str:
    path = (node.authorized_keys_path or "").strip() or "~/.ssh/authorized_keys"
    if path == "~" or path.startswith("~/"):
        path = posixpath.join(home, path[2:])
    return path


def _claim_port(deployment, node, port: int) -> bool:
    """Hold port `port` of the coordinator for this deployment (already held by it: fine)."""

    resource = f"port:{port}"
    if ResourceClaim.objects.filter(node=node, resource=resource, deployment=deployment).exists():
        return True
    try:
        with transaction.atomic():
            ResourceClaim.objects.create(node=node, resource=resource, deployment=deployment)
    except IntegrityError:
        return False
    return True


def _release_port(deployment, node, port: int) -> None:
    ResourceClaim.objects.filter(node=node, resource=f"port:{port}", deployment=deployment).delete()


def _recorded_lines(deployment, key: str) -> list[str]:
    """The authorized_keys lines a guard of this deployment already lists (a heal installs a fresh key under
    the same guard: the lines of earlier runs stay listed until a stop has removed them for sure)."""
    deployment.refresh_from_db(fields=["guards"])
    return list(((deployment.guards or {}).get(key) or {}).get("lines") or [])


async def _edit(transport, worker, path: str, *, remove: str = "", add: str = "") -> None:
    result = await transport.run(rpc_guard.edit_lines_argv(path, remove=remove, add=add), timeout=90)
    if not result.ok:
        why = (
            "; ".join(line.text for line in result.lines[-3:] if line.text) or f"status {result.exit_status}"
        )
        raise JobFailed(f"{worker.name}: could not change {path}: {why}")


async def coordinator_address(ctx, worker, login: dict) -> str:
    """The address the worker's sshd sees the coordinator come from, as SSH_CLIENT shows it to the tunnel
    key's discovery entry (rpc_guard.DISCOVERY_OPTIONS) in one login from the coordinator.

    Not the node record's address: that is where the console reaches the coordinator, which may be a name,
    127.0.0.1 (the console's own host), or another interface than the one the worker sees (a second network,
    a VPN, a NAT between them). sshd matches `from=` against exactly what this login reports."""
    result = await ctx.transport.run(rpc_guard.discovery_argv(**login), timeout=60)
    source = rpc_guard.parse_source(result.stdout)
    if source is None:
        tail = "; ".join(line.text for line in result.lines[-3:] if line.text) or "no output"
        hint = (
            " Does the worker's node setting name the authorized_keys file its sshd reads?"
            if "Permission denied" in tail
            else ""
        )
        raise JobFailed(
            f"{ctx.node.name} could not log in to {worker.name} with the tunnel key to learn the address it "
            f"comes from: {tail}.{hint}"
        )
    await ctx.log(f"{worker.name} sees {ctx.node.name} come from {source}")
    return source


async def unix_forwards(transport) -> str:
    """Whether the worker's sshd lets a login make it listen on a Unix socket (a remote streamlocal
    forward, `ssh -R /path.sock:...`), which no authorized_keys option restricts: "refused", "open", or
    "unknown". Asked over the console's own login (the same user as the tunnel key; its own key may carry
    restrictions of its own, so a refusal counts only when a loopback TCP forward is granted to it)."""
    probe = getattr(transport, "remote_forward_granted", None)
    if probe is None:
        return "unknown"
    path = f"/tmp/{rpc_guard.TUNNEL_MARK}-probe-{secrets.token_hex(6)}.sock"
    try:
        if await probe(path):
            return "open"
        return "refused" if await probe(("127.0.0.1", 0)) else "unknown"
    finally:
        # OpenSSH leaves the socket file behind when the forward closes.
        await transport.run(["rm", "-f", path], timeout=30)


async def report_unix_forwards(ctx, deployment, worker, transport) -> None:
    """Say in the log whether the tunnel key can do more than its one forward; a warning and an audit
    entry when it can (or when that cannot be told)."""
    state = await unix_forwards(transport)
    if state == "refused":
        await ctx.log(f"{worker.name}: sshd refuses Unix-socket forwards, so the key can do nothing else")
        return
    why = (
        "allows Unix-socket forwarding"
        if state == "open"
        else "may allow Unix-socket forwarding (the console's own login could not tell)"
    )
    await ctx.log(
        f"WARNING: {worker.name}'s sshd {why}, which no authorized_keys option limits: whoever holds the "
        f"tunnel key on {ctx.node.name} could also make sshd on {worker.name} listen on a socket path of "
        f"their choosing. Set `AllowStreamLocalForwarding no` in its sshd_config (see SECURITY.md)."
    )
    await db(audit_step)(
        ctx.job, "deployment.tunnel_unix_forwards", deployment, {"node": worker.name, "sshd": state}
    )


async def install_key(ctx, deployment, worker, port: int, tag: str, public: str, login: dict) -> str:
    """Put the tunnel key's entry in the worker's authorized_keys; returns the file's path.

    Two edits over the console's own connection to the worker: first the discovery entry (no forwarding),
    with which the coordinator logs in once to learn the address the worker sees it come from
    (coordinator_address); then that entry is replaced by the restricted one, `from=` that address. Each
    line is recorded in the deployment's guard before it is written, so the stop steps remove exactly the
    lines this deployment wrote, whatever happens in between."""
    first = rpc_guard.discovery_line(public, tag)
    key = f"authorized-key@{worker.name}"
    transport = await db(transport_for)(worker)
    async with transport:
        home = (await transport.run(["printenv", "HOME"], timeout=30)).stdout.strip() or "/root"
        path = authorized_keys_path(worker, home)
        guard = {"node": worker.name, "kind": "authorized-key", "path": path, "tag": tag, "port": port}
        lines = [*(await db(_recorded_lines)(deployment, key)), first]
        await db(deployment.add_guard)(key, {**guard, "lines": lines})
        await _edit(transport, worker, path, add=first)
        try:
            source = await coordinator_address(ctx, worker, login)
        except (JobFailed, TransportError):
            # Gone at once rather than at the rollback (which removes it too: it is in the guard).
            with contextlib.suppress(JobFailed, TransportError):
                await _edit(transport, worker, path, remove=first)
            raise
        line = rpc_guard.authorized_line(public, port, tag, source)
        await db(deployment.add_guard)(key, {**guard, "lines": [*lines, line]})
        await _edit(transport, worker, path, remove=first, add=line)
        await report_unix_forwards(ctx, deployment, worker, transport)
    await ctx.log(
        f"{worker.name}: {path} now lets this deployment's key forward to 127.0.0.1:{port} only, from "
        f"{source} only ({tag})"
    )
    return path


async def start_forward(ctx, deployment, argv_for, log_path: str) -> tuple[int, int]:
    """Start `ssh -tt -L` on the first free loopback port of the coordinator from RAMDECK_RPC_TUNNEL_PORT;
    returns (pid, local port)."""
    first = int(getattr(settings, "RAMDECK_RPC_TUNNEL_PORT", 50300))
    platform = ctx.node.platform
    for local in range(first, first + PORT_ATTEMPTS):
        if not await db(_claim_port)(deployment, ctx.node, local):
            continue  # another deployment's tunnel
        if await find_holders(ctx.transport, platform, local):
            await db(_release_port)(deployment, ctx.node, local)
            continue
        pid = await ctx.start_daemon(argv_for(local), log_path=log_path)
        listening = await wait_forward(ctx, pid, local)
        if listening:
            return pid, local
        await db(_release_port)(deployment, ctx.node, local)
        tail = "\n".join(await tail_lines(ctx, log_path))
        if "Address already in use" not in tail and "cannot listen" not in tail:
            hint = (
                "\nThe worker refused the tunnel key: does its node setting name the authorized_keys file "
                "its sshd reads?"
                if "Permission denied" in tail
                else ""
            )
            raise JobFailed(
                f"the SSH tunnel (PID {pid}) exited before forwarding. Last log lines:\n{tail}{hint}"
            )
    raise JobFailed(f"no free loopback port for the tunnel on {ctx.node.name} from {first} on")


async def wait_forward(ctx, pid: int, port: int, *, timeout: float = 30.0) -> bool:
    """True once `pid` listens on `port`; False when it exited first."""

    platform = ctx.node.platform
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        holders = await find_holders(ctx.transport, platform, port)
        if any(h.pid == pid for h in holders):
            return True
        if not await ctx.transport.pid_alive(pid):
            return False
        if asyncio.get_running_loop().time() >= deadline:
            raise JobFailed(
                f"the SSH tunnel (PID {pid}) did not listen on 127.0.0.1:{port} within {timeout:g} s"
            )
        await asyncio.sleep(0.3)


async def rpc_tunnel_body(ctx) -> str:
    params = ctx.job.params
    deployment = await load_deployment(ctx)
    worker = await db(_worker)(int(params["worker"]))
    port = int(params["port"])
    if not worker.host_key:
        raise JobFailed(f"{worker.name} has no approved host key: the tunnel cannot check whom it reaches")
    tag = rpc_guard.tag_for(deployment.pk, worker.name, settings.RAMDECK_CONSOLE_ID)
    private, public = rpc_guard.new_key_pair(tag)

    directory = await run_dir(ctx)
    stem = posixpath.join(directory, f"d{deployment.pk}-{rpc_guard.TUNNEL_MARK}-{worker.name}")
    key_path, known_hosts, log_path = f"{stem}.key", f"{stem}.known_hosts", f"{stem}.log"
    alias = f"{rpc_guard.TUNNEL_MARK}-{worker.name}"
    login = {
        "key_path": key_path,
        "known_hosts": known_hosts,
        "alias": alias,
        "user": worker.ssh_user or "root",
        "address": worker.address,
        "ssh_port": worker.ssh_port,
    }

    def argv_for(local: int) -> list[str]:
        return rpc_guard.forward_argv(local_port=local, port=port, **login)

    try:
        await write_secret_file(ctx, key_path, private.strip())
        await write_secret_file(ctx, known_hosts, f"{alias} {' '.join(worker.host_key.split()[:2])}")
        await install_key(ctx, deployment, worker, port, tag, public, login)
        pid, local = await start_forward(ctx, deployment, argv_for, log_path)
    except (JobFailed, TransportError):
        await ctx.transport.run(["rm", "-f", key_path, known_hosts], timeout=30)
        raise
    await db(deployment.add_process)(
        f"rpc-tunnel@{worker.name}",
        {
            "node": ctx.node.name,
            "role": "rpc-tunnel",
            "pid": pid,
            "port": local,
            "worker": worker.name,
            "endpoint": params["endpoint"],
            "local_end": f"127.0.0.1:{local}",
            "log": log_path,
            "key_file": key_path,
            "files": [known_hosts],
            "started_at": timezone.now().isoformat(),
        },
    )
    return f"SSH tunnel PID {pid}: 127.0.0.1:{local} on {ctx.node.name} → 127.0.0.1:{port} on {worker.name}"
