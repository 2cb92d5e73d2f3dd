"""Job bodies of a deployment's steps: reap, start ggml-rpc-server, start llama-server, verify, measure, stop.

Each body is `async def body(ctx) -> str`, registered as a job kind of its own (deployments/apps.py) and
run as a child of a deployment's run (deployments/lifecycle/runs.py), which decides the order and the
deployment's state changes. Every process a step starts is recorded by PID in
`Deployment.processes` at once, so a failure later on can end exactly what this deployment started."""

from __future__ import annotations

import asyncio
import contextlib
import posixpath
import secrets

import httpx
from django.conf import settings
from django.utils import timezone

from deployments.endpoint import bind_host, endpoint_url
from deployments.steps.common import load_deployment
from jobs.aio import db
from jobs.context import JobFailed
from jobs.on_node import run_dir, tail_lines, without_key, write_secret_file
from llamacpp import rpc_guard
from llamacpp.args import llama_server_launch_argv, node_cpu_threads
from remote.bounded_http import AnswerTooLarge, fetch

HEALTH_POLL_S = 0.1
LOG_POLL_S = 0.5


def health_timeout_s(model_bytes: int) -> float:
    """Loading reads every weight once (and sends RPC devices theirs): allow a minute plus ~30 s per GiB."""
    per_gib = getattr(settings, "RAMDECK_HEALTH_TIMEOUT_PER_GIB_S", 30.0)
    return 60.0 + per_gib * model_bytes / 2**30


async def follow_until_healthy(ctx, pid: int, log_path: str, url: str, *, timeout: float) -> None:
    """Copy llama-server's log into the job log as it grows and wait for GET /health = 200.

    /health is asked every HEALTH_POLL_S, since the load time is measured by it (a warm load of a few seconds
    was measured half a second late with the log's pace); the log and the process, each an SSH round trip,
    are read every LOG_POLL_S."""
    shown = 0
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    next_log = loop.time()
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            if loop.time() >= next_log:
                result = await ctx.transport.run(["tail", "-n", f"+{shown + 1}", log_path], timeout=30)
                fresh = [line.text for line in result.lines if line.stream == "out"]
                shown += len(fresh)
                for text in fresh:
                    await ctx.log(f"[llama-server] {without_key(text)}")
            with contextlib.suppress(httpx.HTTPError, AnswerTooLarge):
                status, _ = await fetch(client, "GET", f"{url}/health", what="/health answer")
                if status == 200:
                    return
            if loop.time() >= next_log:
                if not await ctx.transport.pid_alive(pid):
                    tail = "\n".join(await tail_lines(ctx, log_path))
                    raise JobFailed(f"llama-server (PID {pid}) exited while loading. Last log lines:\n{tail}")
                next_log = loop.time() + LOG_POLL_S
            if loop.time() >= deadline:
                raise JobFailed(f"llama-server did not become healthy within {timeout:.0f} s")
            if ctx.cancelled():
                raise JobFailed("cancelled while llama-server was loading")
            await asyncio.sleep(HEALTH_POLL_S)


def local_ends(ctx, deployment) -> dict[str, str]:
    """Planned endpoint → where the coordinator reaches it: its tunnel's local end (or its own loopback)."""
    ends = dict(ctx.job.params.get("local_ends") or {})
    for info in (deployment.processes or {}).values():
        if info.get("role") == "rpc-tunnel" and info.get("endpoint"):
            ends[info["endpoint"]] = info["local_end"]
    return ends


async def llama_server_body(ctx) -> str:
    deployment = await load_deployment(ctx)
    build = await db(lambda: ctx.node.current_build)()
    if build is None:
        raise JobFailed(f"{ctx.node.name} has no llama.cpp build")
    directory = await run_dir(ctx)
    port = deployment.port
    log_path = posixpath.join(directory, f"d{deployment.pk}-{ctx.node.name}-llama-server-{port}.log")
    key_path = posixpath.join(directory, f"d{deployment.pk}-{ctx.node.name}-llama-server-{port}.key")
    key = secrets.token_urlsafe(32)
    await db(deployment.store_api_key)(key)
    await write_secret_file(ctx, key_path, key)
    host = bind_host(deployment)
    ends = local_ends(ctx, deployment)
    args = rpc_guard.tunnel_rpc_args(deployment.plan["llama_server_args"], ends)
    # Threads that sleep while they wait, as many as the node's physical cores: a busy machine (the console
    # itself, a browser) then slows decode in proportion instead of stalling it (llamacpp/args.py). The pages
    # show the same command line (deployments/views/plan.py `command_lines`).
    argv = llama_server_launch_argv(
        build.llama_server_path,
        deployment.model_file.path,
        args,
        threads=node_cpu_threads(ctx.node.facts),
        alias=deployment.model_file.name,
        host=host,
        port=port,
        key_file=key_path,
        platform=ctx.node.platform,
    )
    started = asyncio.get_running_loop().time()
    pid = await ctx.start_daemon(argv, log_path=log_path)
    info = {
        "node": ctx.node.name,
        "role": "llama-server",
        "pid": pid,
        "port": port,
        "log": log_path,
        "key_file": key_path,
        "local_ends": ends,
        "started_at": timezone.now().isoformat(),
    }
    await db(deployment.add_process)(f"llama-server@{ctx.node.name}", info)
    url = endpoint_url(deployment)
    timeout = float(
        ctx.job.params.get("health_timeout") or health_timeout_s(deployment.model_file.size_bytes)
    )
    await follow_until_healthy(ctx, pid, log_path, url, timeout=timeout)
    # The load as the household feels it, from the start to the health answer (to within HEALTH_POLL_S, and
    # the SSH round trip that starts it): the measure step sets it beside the plan's prediction
    # (planning/first_word.py).
    load_s = round(asyncio.get_running_loop().time() - started, 2)
    await db(deployment.add_process)(f"llama-server@{ctx.node.name}", {**info, "load_s": load_s})
    await db(deployment.count_load)()
    return f"llama-server PID {pid} healthy at {url} after {load_s:.1f} s"


def llama_process(deployment) -> dict:
    for info in (deployment.processes or {}).values():
        if info.get("role") == "llama-server":
            return info
    raise JobFailed("this deployment has no llama-server process on record")
