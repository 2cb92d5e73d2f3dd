"""The `rpc_tunnel` step: the coordinator's SSH local forward to one worker's ggml-rpc-server.

Runs on the coordinator (its transport is ctx.transport) after the worker's rpc-server listens on
127.0.0.1. It generates a key pair for this deployment and worker, installs the public half on the worker
(over the console's own SSH connection to it) restricted to that one forward, writes the private half and
the worker's pinned host key on the coordinator (0600, in ~/.ramdeck/run), and starts `ssh -tt -L` there
on a free loopback port that the deployment claims. The forward is recorded as a process of the
deployment (role "rpc-tunnel"), the authorized key as a guard: the stop steps end the one and remove the
other (deployments/lifecycle_steps.py). See deployments/rpc_guard.py.
"""

from __future__ import annotations

import posixpath

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from deployments import rpc_guard
from deployments.lifecycle_steps import (
    _write_key_file,
    load_deployment,
    node_platform,
    run_dir,
    tail_lines,
)
from deployments.reaper import find_holders
from jobs.aio import db
from jobs.context import JobFailed
from jobs.transport import TransportError

# How many loopback ports the step tries on the coordinator before it gives up.
PORT_ATTEMPTS = 20


def _worker(pk: int):
    from nodes.models import Node

    return Node.objects.select_related("credential").get(pk=pk)


def _transport_for(node):
    from nodes.transports import transport_for

    return transport_for(node)


def authorized_keys_path(node, home: str) -> str:
    path = (node.authorized_keys_path or "").strip() or "~/.ssh/authorized_keys"
    if path == "~" or path.startswith("~/"):
        path = posixpath.join(home, path[2:])
    return path


def _claim_port(deployment, node, port: int) -> bool:
    """Hold port `port` of the coordinator for this deployment (already held by it: fine)."""
    from deployments.models import ResourceClaim

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
    from deployments.models import ResourceClaim

    ResourceClaim.objects.filter(node=node, resource=f"port:{port}", deployment=deployment).delete()


async def install_key(ctx, deployment, worker, port: int, tag: str, public: str) -> str:
    """Put the tunnel key's restricted entry in the worker's authorized_keys; returns the file's path."""
    line = rpc_guard.authorized_line(public, port, tag)
    transport = await db(_transport_for)(worker)
    async with transport:
        home = (await transport.run(["printenv", "HOME"], timeout=30)).stdout.strip() or "/root"
        path = authorized_keys_path(worker, home)
        # Recorded first: a failure from here on still has the stop steps remove whatever was written.
        await db(deployment.add_guard)(
            f"authorized-key@{worker.name}",
            {"node": worker.name, "kind": "authorized-key", "path": path, "tag": tag, "port": port},
        )
        result = await transport.run(rpc_guard.append_line_argv(path, line), timeout=30)
        if not result.ok:
            raise JobFailed(f"{worker.name}: could not add the tunnel key to {path}: {result.stderr.strip()}")
    await ctx.log(
        f"{worker.name}: {path} now lets this deployment's key forward to 127.0.0.1:{port} only ({tag})"
    )
    return path


async def start_forward(ctx, deployment, argv_for, log_path: str) -> tuple[int, int]:
    """Start `ssh -tt -L` on the first free loopback port of the coordinator from RAMDECK_RPC_TUNNEL_PORT;
    returns (pid, local port)."""
    first = int(getattr(settings, "RAMDECK_RPC_TUNNEL_PORT", 50300))
    platform = node_platform(ctx.node)
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
    import asyncio

    platform = node_platform(ctx.node)
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
    tag = rpc_guard.tag_for(deployment.pk, worker.name)
    private, public = rpc_guard.new_key_pair(tag)
    await install_key(ctx, deployment, worker, port, tag, public)

    directory = await run_dir(ctx)
    stem = posixpath.join(directory, f"d{deployment.pk}-{rpc_guard.TUNNEL_MARK}-{worker.name}")
    key_path, known_hosts, log_path = f"{stem}.key", f"{stem}.known_hosts", f"{stem}.log"
    alias = f"{rpc_guard.TUNNEL_MARK}-{worker.name}"
    await _write_key_file(ctx, key_path, private.strip())
    await _write_key_file(ctx, known_hosts, f"{alias} {' '.join(worker.host_key.split()[:2])}")

    def argv_for(local: int) -> list[str]:
        return rpc_guard.forward_argv(
            key_path=key_path,
            known_hosts=known_hosts,
            alias=alias,
            local_port=local,
            port=port,
            user=worker.ssh_user or "root",
            address=worker.address,
            ssh_port=worker.ssh_port,
        )

    try:
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
