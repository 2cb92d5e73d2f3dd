"""Job bodies of a deployment's steps: reap, start ggml-rpc-server, start llama-server, verify, measure, stop.

Each body is `async def body(ctx) -> str`, registered as a job kind of its own (deployments/apps.py) and
run as a child of a deployment's run (deployments/lifecycle_runs.py), which decides the order and the
deployment's state changes. Every process a step starts is recorded by PID in
`Deployment.processes` at once, so a failure later on can end exactly what this deployment started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import posixpath
import secrets

import httpx
from django.conf import settings
from django.utils import timezone

from deployments import llamacpp, placement, rpc_guard
from deployments.bounded_http import AnswerTooLarge, fetch
from deployments.reaper import ForeignHolder, PortStillBusy, classify, cmdline_argv, find_holders, reap_port
from jobs.aio import db
from jobs.context import JobFailed
from nodes.listeners import redact_cmdline

MEASURE_PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a short story about a fox:"
MEASURE_TOKENS = 32


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def node_platform(node) -> str:
    """ "linux", "macos" or "windows": the operator's hint, else what the probe found."""
    if node.platform_hint and node.platform_hint != "auto":
        return node.platform_hint
    facts = node.facts or {}
    text = " ".join(str(facts.get(key, "")) for key in ("platform", "os", "system", "os_name")).lower()
    if "darwin" in text or "mac" in text:
        return "macos"
    if "windows" in text:
        return "windows"
    return "linux"


async def run_dir(ctx) -> str:
    """~/.ramdeck/run on the node: logs and key files of the processes the console starts."""
    home = (await ctx.transport.run(["printenv", "HOME"], timeout=30)).stdout.strip() or "/tmp"
    path = posixpath.join(home, ".ramdeck", "run")
    await ctx.transport.run(["mkdir", "-p", path], timeout=30)
    return path


def _deployment(pk: int):
    from deployments.models import Deployment

    return Deployment.objects.select_related("coordinator", "model_file").get(pk=pk)


async def load_deployment(ctx):
    return await db(_deployment)(ctx.job.params["deployment"])


def _audit(job, action: str, obj, changes: dict) -> None:
    from audit.history import record

    record(job.created_by, action, obj, changes=changes, actor_name="" if job.created_by_id else "console")


async def runs_our_program(transport, platform: str, pid: int, role: str) -> tuple[bool, str]:
    """Is `pid` still the `role` process we started? PIDs are reused: a process that ended long ago may
    have left its PID to something else, which must be neither killed nor taken for our server.
    Returns (ours, its command line)."""
    result = await transport.run(cmdline_argv(platform, pid), timeout=30)
    # Redacted here, where it is read: whatever a caller logs or shows of it carries no key.
    cmdline = redact_cmdline(result.stdout.strip())
    return bool(cmdline) and classify(cmdline) == role, cmdline


async def tail_lines(ctx, path: str, count: int = 20) -> list[str]:
    result = await ctx.transport.run(["tail", "-n", str(count), path], timeout=30)
    return [line.text for line in result.lines if line.stream == "out"]


def bind_host(deployment) -> str:
    """llama-server's --host. A loopback address on a remote coordinator could not be reached by the
    console (or anyone else), so it binds to the coordinator's own address instead."""
    host = deployment.host or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1") and not deployment.coordinator.is_local:
        return deployment.coordinator.address
    return host


def reach_host(deployment) -> str:
    """Where clients (and the console) reach llama-server: where it binds, or the coordinator's address
    when it binds to every interface."""
    host = bind_host(deployment)
    return deployment.coordinator.address if host in ("0.0.0.0", "::") else host


def endpoint_url(deployment) -> str:
    host = reach_host(deployment)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{deployment.port}"


def health_timeout_s(model_bytes: int) -> float:
    """Loading reads every weight once (and sends RPC devices theirs): allow a minute plus ~30 s per GiB."""
    per_gib = getattr(settings, "RAMDECK_HEALTH_TIMEOUT_PER_GIB_S", 30.0)
    return 60.0 + per_gib * model_bytes / 2**30


# --------------------------------------------------------------------------------------------------
# reap
# --------------------------------------------------------------------------------------------------


def _owner_of(node, port: int, pid: int) -> str:
    """Which active deployment holds this port or PID of the node ("" when none does)."""
    from deployments.models import ACTIVE_STATES, Deployment, ResourceClaim

    claim = (
        ResourceClaim.objects.filter(node=node, resource=f"port:{port}", deployment__state__in=ACTIVE_STATES)
        .select_related("deployment")
        .first()
    )
    if claim is not None:
        return f"port {port} is claimed by deployment {claim.deployment}"
    for deployment in Deployment.objects.filter(state__in=ACTIVE_STATES):
        for info in (deployment.processes or {}).values():
            if info.get("node") == node.name and int(info.get("pid") or 0) == pid:
                return f"PID {pid} is {info.get('role')} of deployment {deployment}"
    return ""


async def reap_pid(ctx, port: int, pid: int) -> str:
    """The one-click reap of a stale process: end exactly that PID, and only while it still holds the port,
    still runs one of our programs, and no active deployment claims the port or the PID. Whatever else
    holds the port now is left alone (the PID the scan saw may have ended and the port found a new owner)."""
    holders = await find_holders(ctx.transport, node_platform(ctx.node), port)
    holder = next((h for h in holders if h.pid == pid), None)
    if holder is None:
        await ctx.log(f"PID {pid} no longer holds port {port}; nothing was ended")
        return f"{ctx.node.name}: PID {pid} no longer holds port {port}; nothing to do"
    if not holder.ours:
        raise JobFailed(f"{ctx.node.name}: PID {pid} is not ours now ({holder.describe()}); not touched")
    owner = await db(_owner_of)(ctx.node, port, pid)
    if owner:
        raise JobFailed(f"{ctx.node.name}: {owner}; PID {pid} not touched")
    await ctx.log(f"port {port}: stale {holder.kind} PID {pid} ({holder.cmdline}); sending TERM")
    if not await ctx.transport.kill(pid, grace=settings.RAMDECK_KILL_GRACE_S):
        raise JobFailed(f"{ctx.node.name}: {holder.kind} PID {pid} did not end")
    await db(_audit)(
        ctx.job,
        "process.reaped",
        ctx.node,
        {"pid": pid, "port": port, "program": holder.kind, "cmdline": holder.cmdline[:300]},
    )
    return f"{ctx.node.name}: port {port}: reaped {holder.kind} PID {pid}"


async def reap_body(ctx) -> str:
    """End stale rpc-server/llama-server processes holding the given ports; fail naming any foreign holder.
    With params["pid"] (the dashboard's reap button), only that process is ended (see reap_pid)."""
    ports = [int(p) for p in ctx.job.params.get("ports") or [ctx.node.rpc_port]]
    if ctx.job.params.get("pid"):
        return await reap_pid(ctx, ports[0], int(ctx.job.params["pid"]))
    platform = node_platform(ctx.node)
    summaries = []
    for port in ports:
        try:
            outcome = await reap_port(
                ctx.transport, platform, port, log=ctx.log, grace=settings.RAMDECK_KILL_GRACE_S
            )
        except (ForeignHolder, PortStillBusy) as exc:
            raise JobFailed(f"{ctx.node.name}: {exc}") from exc
        for holder in outcome.reaped:
            await db(_audit)(
                ctx.job,
                "process.reaped",
                ctx.node,
                {"pid": holder.pid, "port": port, "program": holder.kind, "cmdline": holder.cmdline[:300]},
            )
        summaries.append(outcome.summary)
    return f"{ctx.node.name}: " + "; ".join(summaries)


# --------------------------------------------------------------------------------------------------
# ggml-rpc-server
# --------------------------------------------------------------------------------------------------


async def wait_listening(ctx, pid: int, port: int, log_path: str, *, timeout: float) -> None:
    """Until `pid` listens on `port` on the node. An rpc-server given a bad option prints usage and exits
    with status 0, so "alive and listening" is the test, never the exit status."""
    platform = node_platform(ctx.node)
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        holders = await find_holders(ctx.transport, platform, port)
        if any(h.pid == pid for h in holders):
            return
        others = [h for h in holders if h.pid != pid]
        if not await ctx.transport.pid_alive(pid):
            tail = "\n".join(await tail_lines(ctx, log_path))
            held = f" Port {port} is held by {others[0].describe()}." if others else ""
            raise JobFailed(
                f"PID {pid} exited before listening on port {port}.{held} Last log lines:\n{tail}"
            )
        if asyncio.get_running_loop().time() >= deadline:
            raise JobFailed(f"PID {pid} is alive but did not listen on port {port} within {timeout:g} s")
        await asyncio.sleep(0.3)


async def rpc_server_body(ctx) -> str:
    params = ctx.job.params
    deployment = await load_deployment(ctx)
    build = await db(lambda: ctx.node.current_build)()
    if build is None:
        raise JobFailed(f"{ctx.node.name} has no llama.cpp build")
    port = int(params["port"])
    directory = await run_dir(ctx)
    # Named per deployment and node: nodes may share a home folder (NFS), and history stays readable.
    log_path = posixpath.join(directory, f"d{deployment.pk}-{ctx.node.name}-rpc-server-{port}.log")
    argv = [build.rpc_server_path, *params["args"]]
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
        banner_text = "\n".join(await tail_lines(ctx, log_path, 40))
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


async def _unfence_after_failure(ctx, pid: int | None, guard: dict) -> None:
    """The step failed after its firewall rule went in: end the server it started, then take the rule out
    (not the other way round: a live server behind no rule is what the rule is for). A server that does not
    end keeps its rule; the rollback's stop step tries both again (the guard stays recorded)."""
    with contextlib.suppress(Exception):
        if pid is not None and not await ctx.transport.kill(pid, grace=settings.RAMDECK_KILL_GRACE_S):
            await ctx.log(f"rpc-server PID {pid} did not end; its firewall rule stays for the rollback")
            return
        await ctx.log(f"the step failed: {await remove_guard(ctx, guard)}")


async def may_administer(ctx, rule: list[str]) -> bool | None:
    """How the SSH user may insert and delete the firewall rule `rule`: False as root, True through
    `sudo -n`, None: it may not. With sudo, exactly those two iptables commands are checked (`sudo -n -l`,
    which runs nothing), so a sudoers line that allows only them (rpc_guard.SUDOERS_LINE) is enough."""
    if (await ctx.transport.run(["id", "-u"], timeout=30)).stdout.strip() == "0":
        return False
    # A node without sudo at all answers no (the transport reports a missing program as an error).
    if not (await ctx.transport.run(["sh", "-c", "command -v sudo"], timeout=30)).ok:
        return None
    for action in ("-I", "-D"):
        if not (await ctx.transport.run(rpc_guard.sudo_allows_argv(action, rule), timeout=30)).ok:
            return None
    return True


async def install_firewall(ctx, deployment, port: int, firewall: dict) -> tuple[str, dict | None]:
    """Direct mode: an iptables rule that refuses every source but the coordinator on the RPC port, where
    the SSH user may add one. Recorded as a guard first, so the stop steps remove it. Returns the note for
    the step's result and the guard (None when no rule went in)."""
    coordinator = firewall.get("coordinator")
    if node_platform(ctx.node) != "linux" or not coordinator:
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


async def unfenced(ctx, deployment, port: int, why: str) -> str:
    """Direct mode without a firewall rule: said in the log and in the audit history, and the run goes on
    (the operator chose direct mode; tunnel mode is what keeps the port to the coordinator there)."""
    await ctx.log(
        f"WARNING: no firewall rule on {ctx.node.name} ({why}): port {port} is open to the whole network. "
        "Tunnel mode keeps it to the coordinator."
    )
    await db(_audit)(
        ctx.job, "deployment.rpc_unfenced", deployment, {"node": ctx.node.name, "port": port, "why": why}
    )
    return f" (no firewall rule: {why})"


async def remove_guard(ctx, info: dict) -> str:
    """Undo one guard (an authorized key, a firewall rule); removing one already gone is fine."""
    if info["kind"] == "authorized-key":
        # Exactly the lines this deployment wrote (under the file's lock); a guard recorded by an older
        # console, before the lines were, goes by its tag.
        lines = info.get("lines")
        argvs = (
            [rpc_guard.remove_line_argv(info["path"], line) for line in lines]
            if lines
            else [rpc_guard.remove_tagged_argv(info["path"], info["tag"])]
        )
        for argv in argvs:
            result = await ctx.transport.run(argv, timeout=90)
            if not result.ok:
                why = "; ".join(line.text for line in result.lines[-3:] if line.text)
                raise JobFailed(
                    f"could not remove the tunnel key {info['tag']} from {info['path']}"
                    + (f": {why}" if why else "")
                )
        return f"tunnel key {info['tag']} removed from {info['path']}"
    if info["kind"] == "firewall":
        removed = 0
        for _ in range(10):  # the same rule added twice (a retried step) is removed twice
            argv = rpc_guard.iptables_argv("-D", info["rule"], sudo=info.get("sudo", False))
            if not (await ctx.transport.run(argv, timeout=60)).ok:
                break
            removed += 1
        return f"firewall rule {info['tag']} removed" if removed else f"firewall rule {info['tag']} was gone"
    return f"unknown guard {info['kind']} left alone"


# --------------------------------------------------------------------------------------------------
# llama-server
# --------------------------------------------------------------------------------------------------


async def _write_key_file(ctx, path: str, key: str) -> None:
    """A key reaches the node as a file created 0600, never in a command line (visible in `ps`) or a log,
    and straight from memory: over SFTP to a remote node, by os.open on the console's own host, never
    through a temporary file on the console's host."""
    await ctx.transport.write_file(path, (key + "\n").encode(), mode=0o600)


def _without_key(text: str) -> str:
    """llama-server prints the API key's last characters at start; even those stay out of the job log."""
    return redact_cmdline(text)


async def follow_until_healthy(ctx, pid: int, log_path: str, url: str, *, timeout: float) -> None:
    """Copy llama-server's log into the job log as it grows and wait for GET /health = 200."""
    shown = 0
    deadline = asyncio.get_running_loop().time() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            result = await ctx.transport.run(["tail", "-n", f"+{shown + 1}", log_path], timeout=30)
            fresh = [line.text for line in result.lines if line.stream == "out"]
            shown += len(fresh)
            for text in fresh:
                await ctx.log(f"[llama-server] {_without_key(text)}")
            with contextlib.suppress(httpx.HTTPError, AnswerTooLarge):
                status, _ = await fetch(client, "GET", f"{url}/health", what="/health answer")
                if status == 200:
                    return
            if not await ctx.transport.pid_alive(pid):
                tail = "\n".join(await tail_lines(ctx, log_path))
                raise JobFailed(f"llama-server (PID {pid}) exited while loading. Last log lines:\n{tail}")
            if asyncio.get_running_loop().time() >= deadline:
                raise JobFailed(f"llama-server did not become healthy within {timeout:.0f} s")
            if ctx.cancelled():
                raise JobFailed("cancelled while llama-server was loading")
            await asyncio.sleep(0.5)


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
    await _write_key_file(ctx, key_path, key)
    host = bind_host(deployment)
    ends = local_ends(ctx, deployment)
    args = rpc_guard.tunnel_rpc_args(deployment.plan["llama_server_args"], ends)
    argv = [
        build.llama_server_path,
        "-m",
        deployment.model_file.path,
        *args,
        # The OpenAI-style API answers to the model's name in the console, not to its file path.
        "--alias",
        llamacpp.model_alias(deployment.model_file.name),
        "--host",
        host,
        "--port",
        str(port),
        "--api-key-file",
        key_path,
        "--metrics",
        "-lv",
        "4",
    ]
    pid = await ctx.start_daemon(argv, log_path=log_path)
    await db(deployment.add_process)(
        f"llama-server@{ctx.node.name}",
        {
            "node": ctx.node.name,
            "role": "llama-server",
            "pid": pid,
            "port": port,
            "log": log_path,
            "key_file": key_path,
            "local_ends": ends,
            "started_at": timezone.now().isoformat(),
        },
    )
    url = endpoint_url(deployment)
    timeout = float(
        ctx.job.params.get("health_timeout") or health_timeout_s(deployment.model_file.size_bytes)
    )
    await follow_until_healthy(ctx, pid, log_path, url, timeout=timeout)
    return f"llama-server PID {pid} healthy at {url}"


# --------------------------------------------------------------------------------------------------
# verify and measure
# --------------------------------------------------------------------------------------------------


def _llama_process(deployment) -> dict:
    for info in (deployment.processes or {}).values():
        if info.get("role") == "llama-server":
            return info
    raise JobFailed("this deployment has no llama-server process on record")


async def verify_body(ctx) -> str:
    deployment = await load_deployment(ctx)
    info = _llama_process(deployment)
    pattern = "buffer size|offloaded|n_ctx|n_seq_max|n_slots|training context"
    result = await ctx.transport.run(["grep", "-E", pattern, info["log"]], timeout=60)
    log_text = "\n".join(line.text for line in result.lines if line.stream == "out")
    log_text = rpc_guard.planned_endpoints_in(log_text, info.get("local_ends") or {})
    report = placement.compare(deployment.plan, log_text)
    for line in report["lines"]:
        await ctx.log(line)
    # The context llama.cpp really gave the slots is the one shown from now on, beside the one asked for.
    report["context"] = context = llamacpp.parse_context_log(log_text.splitlines())
    await db(deployment.record)(verification=report, ctx_used=context["total"])
    if context["total"] is not None and context["total"] != deployment.ctx_requested:
        await ctx.log(
            f"context: llama.cpp uses {context['total']} tokens ({context['per_slot']} per slot), "
            f"{deployment.ctx_requested} were asked for; {deployment.ctx_note()}"
        )
    if report["problems"]:
        message = "placement differs from the plan: " + "; ".join(report["problems"])
        if getattr(settings, "RAMDECK_PLACEMENT_MISMATCH", "fail") == "fail":
            raise JobFailed(message)
        await ctx.log("WARNING: " + message)
        return "placement differs from the plan (warned, not failed)"
    return f"placement matches the plan on {len(report['devices'])} device(s)"


async def measure_body(ctx) -> str:
    deployment = await load_deployment(ctx)
    key = await db(deployment.api_key)()
    url = endpoint_url(deployment)
    body = {"prompt": MEASURE_PROMPT, "n_predict": MEASURE_TOKENS, "cache_prompt": False}
    async with httpx.AsyncClient(timeout=600.0) as client:
        try:
            # Read with a bound: 32 tokens and their timings are a few kB, whatever the node sends.
            status, raw = await fetch(
                client,
                "POST",
                f"{url}/completion",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                what="/completion answer",
            )
        except AnswerTooLarge as exc:
            raise JobFailed(f"{exc}; cannot measure") from None
    text = raw.decode("utf-8", "replace")
    if status != 200:
        raise JobFailed(f"POST /completion answered {status}: {text[:300]}")
    try:
        answer = json.loads(text)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise JobFailed(f"llama-server's /completion answer is not a JSON object: {text[:200]!r}")
    timings = answer.get("timings") or {}
    decode = timings.get("predicted_per_second")
    prompt = timings.get("prompt_per_second")
    if not isinstance(decode, int | float) or not isinstance(prompt, int | float):
        # An older or differently built llama-server may answer without timings: say so, not a TypeError.
        raise JobFailed(
            "llama-server answered /completion without speed timings "
            f"(predicted_per_second={decode!r}, prompt_per_second={prompt!r}); cannot measure"
        )
    predicted = (deployment.plan or {}).get("predicted_tokens_per_s")
    await db(deployment.record)(
        measured_decode_tps=decode, measured_prompt_tps=prompt, predicted_decode_tps=predicted
    )
    error = deployment.speed_error
    off = f" ({error:+.0%} against the prediction)" if error is not None else ""
    await ctx.log(
        f"decode {decode:.1f} tokens/s (predicted {predicted or 0:.1f}){off}; prompt {prompt:.1f} tokens/s"
    )
    advice = await db(deployment.recalibration_advice)()
    if advice:
        await ctx.log(f"The prediction is off by more than 25%: calibrate {', '.join(advice)} again.")
    return f"decode {decode:.1f} tok/s (predicted {predicted or 0:.1f}), prompt {prompt:.1f} tok/s"


# --------------------------------------------------------------------------------------------------
# stop (also the rollback of a failed launch)
# --------------------------------------------------------------------------------------------------


async def stop_body(ctx) -> str:
    """End this deployment's processes on the node by PID, then confirm their ports are free."""
    processes = ctx.job.params.get("processes", [])
    platform = node_platform(ctx.node)
    done = []
    for info in processes:
        pid = int(info["pid"])
        alive = await ctx.transport.pid_alive(pid)
        if alive:
            ours, cmdline = await runs_our_program(ctx.transport, platform, pid, info["role"])
            if not ours:
                await ctx.log(f"PID {pid} now runs another program ({cmdline or 'gone'}); not touched")
                alive = False
        if alive:
            await ctx.log(f"ending {info['role']} PID {pid}")
            gone = await ctx.transport.kill(pid, grace=settings.RAMDECK_KILL_GRACE_S)
            if not gone:
                raise JobFailed(f"{info['role']} PID {pid} on {ctx.node.name} did not end")
            done.append(f"{info['role']} PID {pid} ended")
        else:
            await ctx.log(f"{info['role']} PID {pid} was not running")
            done.append(f"{info['role']} PID {pid} already gone")
        files = [f for f in (info.get("key_file"), *info.get("files", [])) if f]
        if files:
            await ctx.transport.run(["rm", "-f", *files], timeout=30)
        # What else holds the port now? A leftover of ours is reaped; a foreign holder fails the stop.
        try:
            await reap_port(ctx.transport, platform, int(info["port"]), log=ctx.log)
        except (ForeignHolder, PortStillBusy) as exc:
            raise JobFailed(str(exc)) from exc
    for guard in ctx.job.params.get("guards", []):
        note = await remove_guard(ctx, guard)
        await ctx.log(note)
        done.append(note)
    return f"{ctx.node.name}: " + ("; ".join(done) or "nothing to stop")
