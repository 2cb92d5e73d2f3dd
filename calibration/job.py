"""The `calibrate` job: measure what a node delivers, with its own llama.cpp build and a generated model.

Single-stream decode reads every weight once per token, so a device's speed is "bytes of weights per second"
plus a fixed cost per token. Both are measured here the way a deployment will use the device: through a
`ggml-rpc-server` on the node (so a CPU quota, a thermal limit or slow memory shows), driven by a
`llama-server` on the same node, decoding two generated models of the same width and different depth:

    seconds per token = fixed + bytes read per token / bandwidth

Two depths give two points of that line: the slope is the device's effective bandwidth, the intercept the
fixed per-token cost of a pass through its rpc-server. A tiny model inside llama-server alone gives the cost
of a pass when this node coordinates (`pass_overhead_ms`), through one rpc-server what a hop adds to it
(`rpc_hop_ms`), and through two what splitting across servers adds beyond their hops
(`pipeline_overhead_ms`). On a node
that may coordinate, the CPU is also measured inside llama-server itself, with llama-server's threads, as
the blocks a plan keeps on the coordinator's CPU run. Last, the console speaks the RPC protocol to the node's
RPC port to time the link (llamacpp/rpc_wire.py).

ggml-rpc-server has no authentication: every server of the device runs binds 127.0.0.1 (llama-server runs on
the same node), and the one the link is timed on is reached through the protection a deployment would use
on the node, an SSH tunnel or the direct-mode firewall rule, or not at all (calibration/link.py).

On a node whose CPU quota is below its core count (a container's limit, a cgroup), llama-server beside the
rpc-server spends the same quota, which in a deployment the rpc-server has to itself: there the CPU time both
use during the samples (/proc/PID/stat) splits each run's time of the CPU device, and only the rpc-servers'
share counts for its line and the hop (`Run.device_seconds_per_token`). A GPU's time is not the CPU's, and
is taken as measured.

The models are written once on the console (llamacpp/tiny_model.py), cached in RAMDECK_VAR_DIR, and
uploaded over SFTP into ~/.ramdeck/calibrate on the node, where they stay for the next calibration. Every
process this job starts is ended by PID before it finishes, whatever happens. A node that serves a running
deployment is not calibrated (the measurement would disturb it, and it needs the RPC port).

The job's single entry is `calibrate_body(ctx)`; the line fit is calibration/fit.py and storing the figures
calibration/store.py."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import posixpath
import secrets
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings

from calibration import link as calibrate_link
from calibration.fit import (
    CalibrationModel,
    FixedCosts,
    Run,
    comparable,
    cpu_ticks,
    fit,
    prompt_gflops,
    rpc_share,
)
from calibration.store import locked_refusal, store
from jobs.aio import db
from jobs.context import JobCancelled, JobFailed
from jobs.on_node import run_dir, tail_lines, wait_listening, write_secret_file
from llamacpp.args import node_cpu_threads, quiet_argv, quiet_llama_server_args, quiet_rpc_server_args
from llamacpp.gguf import profile_path
from llamacpp.reaper import find_holders
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from planning.first_word import block_flops, output_flops
from remote.base import TransportError

# Two models of the same width and different depth: ~100 and ~300 MB of f16 weights, each over three times
# the 32 MiB last-level cache of a typical desktop CPU (at half that width the shallow model ran partly from
# the cache, and its line under-predicted every larger model by 10 to 30%), small enough to upload in
# seconds and to fit any device that can run a model at all. The width of a small real model (n_embd 1536):
# a narrower one pays a larger share of its time at the operations' barriers, which real models do not.
# And a tiny one (~1 MB, two blocks) whose time per token is almost all fixed cost: through one rpc-server
# and through two it shows what a pass costs and what one more hop in the chain adds.
WIDTH = {"n_embd": 1536, "n_head": 12, "n_head_kv": 4, "n_ff": 4096, "n_ctx_train": 2048}


MODELS = {
    "shallow": TinyLlama(n_layer=2, seed=11, **WIDTH),
    "deep": TinyLlama(n_layer=6, seed=12, **WIDTH),
    "tiny": TinyLlama(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_ctx_train=2048, seed=13),
}


CTX = 512
# Ports a calibration run of llama-server tries before it gives up (each picked at random, see timed_run).
PORT_ATTEMPTS = 3


PROMPT = "The quick brown fox jumps over the lazy dog."


# A prompt of a few hundred tokens (the models' byte-level vocabulary spends three on a space's "▁"; eight
# sentences were more than the context), processed in one ubatch of llama.cpp's default 512 within the
# calibration's context: the device's prompt throughput.
BATCH_PROMPT = " ".join(f"{PROMPT} {i}" for i in range(5))
PROMPT_SAMPLES = 2


SAMPLES = 3


# Each sample decodes about this long (the token count follows the speed the warm-up showed).
SAMPLE_SECONDS = 1.0


MIN_TOKENS, MAX_TOKENS = 16, 192


HEALTH_TIMEOUT_S = 120.0


def _spec_digest(spec: TinyLlama) -> str:
    return hashlib.sha256(repr(spec).encode()).hexdigest()[:12]


def prepared_models() -> list[CalibrationModel]:
    """The calibration models on the console, written once (under a lock: jobs run in parallel)."""
    folder = Path(settings.VAR_DIR) / "calibration"
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name, spec in MODELS.items():
            filename = f"ramdeck-calibrate-{name}-{_spec_digest(spec)}.gguf"
            path = folder / filename
            if not path.exists():
                partial = folder / f".{filename}.{secrets.token_hex(4)}.part"
                write_tiny_llama(partial, spec)
                os.replace(partial, path)
            profile = profile_path(path)
            read = sum(profile["block_weight_bytes"]) + int(profile["output_bytes"])
            matrices, attention = block_flops(profile)
            out.append(
                CalibrationModel(
                    name,
                    str(path),
                    filename,
                    path.stat().st_size,
                    read,
                    matrix_flops=sum(matrices),
                    attention_flops=sum(attention),
                    output_flops=output_flops(profile),
                )
            )
    return out


async def _remote_size(ctx, path: str) -> int | None:
    result = await ctx.transport.run(["sh", "-c", 'wc -c < "$1"', "size", path], timeout=30)
    text = result.stdout.strip()
    return int(text) if result.exit_status == 0 and text.isdigit() else None


async def upload_models(ctx, models: list[CalibrationModel], folder: str) -> dict[str, str]:
    """Each model at `folder` on the node (uploaded unless a file of its size is there); name -> path."""
    await ctx.run(["mkdir", "-p", folder], timeout=60, echo=False)
    paths = {}
    uploaded = False
    for model in models:
        remote = posixpath.join(folder, model.remote_name)
        if await _remote_size(ctx, remote) != model.size_bytes:
            await ctx.log(f"uploading the {model.name} calibration model ({model.size_bytes / 1e6:.0f} MB)")
            # A name of its own, then a rename: parallel calibrations of nodes sharing a home folder (NFS)
            # never see a half-written model.
            partial = f"{remote}.{secrets.token_hex(4)}.part"
            await ctx.transport.upload(model.local_path, partial)
            await ctx.run(["mv", "-f", partial, remote], timeout=60, echo=False)
            uploaded = True
        paths[model.name] = remote
    if uploaded:
        # The kernel writes the new files out in the background, on the node's CPU and memory bus:
        # measured during that, a node's first calibration came out a quarter below its next ones.
        await ctx.run(["sync"], timeout=600, echo=False)
    return paths


class Processes:
    """The PIDs this job started on the node, ended (TERM, then KILL) when the job is done with them."""

    def __init__(self, ctx) -> None:
        self.ctx = ctx
        self.pids: list[int] = []

    async def start(self, argv: list[str], log_path: str) -> int:
        pid = await self.ctx.start_daemon(argv, log_path=log_path)
        self.pids.append(pid)
        return pid

    async def end(self, pid: int) -> bool:
        """End `pid` if this job started it; whether it is gone."""
        if pid not in self.pids:
            return True
        self.pids.remove(pid)
        return await self.ctx.transport.kill(pid, grace=settings.RAMDECK_KILL_GRACE_S)

    async def end_all(self) -> bool:
        """End every process still running; whether all of them are gone."""
        gone = True
        for pid in list(reversed(self.pids)):
            try:
                gone = await self.end(pid) and gone
            except Exception:
                gone = False
        return gone


def _llama_host(node) -> str:
    """Where the calibration llama-server listens: loopback on the console's own host, else the node's
    address (the console must reach it). It has an API key and lives for seconds."""
    return "127.0.0.1" if node.is_local else node.address


async def _wait_healthy(ctx, procs: Processes, pid: int, url: str, log_path: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HEALTH_TIMEOUT_S
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            if not await ctx.transport.pid_alive(pid):
                tail = "\n".join(await tail_lines(ctx, log_path))
                raise JobFailed(
                    f"llama-server exited while loading the calibration model. Last lines:\n{tail}"
                )
            if loop.time() >= deadline:
                raise JobFailed(f"llama-server did not load the calibration model in {HEALTH_TIMEOUT_S:g} s")
            if ctx.cancelled():
                raise JobCancelled()
            await asyncio.sleep(0.3)


async def _decode(client: httpx.AsyncClient, url: str, key: str, tokens: int) -> float:
    body = {"prompt": PROMPT, "n_predict": tokens, "cache_prompt": False, "ignore_eos": True}
    response = await client.post(f"{url}/completion", json=body, headers={"Authorization": f"Bearer {key}"})
    if response.status_code != 200:
        raise JobFailed(
            f"llama-server answered /completion with {response.status_code}: {response.text[:200]}"
        )
    speed = (response.json().get("timings") or {}).get("predicted_per_second")
    if not isinstance(speed, int | float) or speed <= 0:
        raise JobFailed("llama-server's answer carried no decode speed (timings.predicted_per_second)")
    return float(speed)


async def _prompt(client: httpx.AsyncClient, url: str, key: str) -> tuple[int, float]:
    """One batch run: the prompt processed and one token decoded; (prompt tokens, prompt tokens/s)."""
    body = {"prompt": BATCH_PROMPT, "n_predict": 1, "cache_prompt": False}
    response = await client.post(f"{url}/completion", json=body, headers={"Authorization": f"Bearer {key}"})
    if response.status_code != 200:
        raise JobFailed(
            f"llama-server answered /completion with {response.status_code}: {response.text[:200]}"
        )
    timings = response.json().get("timings") or {}
    n, speed = timings.get("prompt_n"), timings.get("prompt_per_second")
    if not isinstance(n, int) or not isinstance(speed, int | float) or speed <= 0:
        raise JobFailed("llama-server's answer carried no prompt speed (timings.prompt_n, prompt_per_second)")
    return n, float(speed)


async def read_cpu_ticks(ctx, pids: list[int]) -> dict[int, int] | None:
    """The CPU ticks the processes have used so far (Linux /proc), or None when one cannot be read."""
    script = 'for p; do cat "/proc/$p/stat" || exit 1; done'
    try:
        result = await ctx.transport.run(["sh", "-c", script, "ticks", *map(str, pids)], timeout=30)
    except TransportError:
        return None
    ticks = cpu_ticks(result.stdout) if result.exit_status == 0 else {}
    return ticks if set(ticks) == set(pids) else None


async def timed_run(
    ctx,
    procs: Processes,
    build,
    model_path: str,
    model: CalibrationModel,
    placement: list[str],
    workdir: str,
    label: str,
    *,
    rpc_pids: Sequence[int] = (),
    prompt: bool = False,
) -> Run:
    """Start llama-server with `placement` arguments, decode a few times, end it; the speeds it reported.

    With `rpc_pids` (the node's rpc-servers this run drives, on a node with a CPU quota) the CPU time they
    and llama-server use during the samples is read too, for `Run.device_seconds_per_token`."""
    tag = f"calibrate-{ctx.job.pk}-{label}-{model.name}"
    log_path = posixpath.join(workdir, f"{tag}.log")
    key_path = posixpath.join(workdir, f"{tag}.key")
    key = secrets.token_urlsafe(24)
    await write_secret_file(ctx, key_path, key)
    host = _llama_host(ctx.node)
    try:
        # A port picked at random can be taken meanwhile (the range is the kernel's ephemeral one too):
        # llama-server then says it "couldn't bind", and another port is tried.
        for attempt in range(1, PORT_ATTEMPTS + 1):
            port = 40000 + secrets.randbelow(20000)
            argv = [build.llama_server_path, "-m", model_path, "-c", str(CTX), "-np", "1", "--fit", "off"]
            argv += [*placement, "--host", host, "--port", str(port), "--api-key-file", key_path]
            pid = await procs.start(quiet_argv(argv, ctx.node.platform), log_path)
            url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
            try:
                await _wait_healthy(ctx, procs, pid, url, log_path)
                break
            except JobFailed as exc:
                await procs.end(pid)
                if "couldn't bind" not in str(exc) or attempt == PORT_ATTEMPTS:
                    raise
                await ctx.log(f"port {port} was taken on {ctx.node.name}: llama-server tries another")
    except BaseException:
        await ctx.transport.run(["rm", "-f", key_path, log_path], timeout=30)
        raise
    try:
        async with httpx.AsyncClient(timeout=300.0) as client:
            warm = await _decode(client, url, key, 8)
            tokens = int(min(MAX_TOKENS, max(MIN_TOKENS, warm * SAMPLE_SECONDS)))
            speeds = []
            watched = [pid, *rpc_pids]
            before = await read_cpu_ticks(ctx, watched) if rpc_pids else None
            for _ in range(SAMPLES):
                if ctx.cancelled():
                    raise JobCancelled()
                speeds.append(await _decode(client, url, key, tokens))
            after = await read_cpu_ticks(ctx, watched) if rpc_pids else None
            prompts = [await _prompt(client, url, key) for _ in range(PROMPT_SAMPLES)] if prompt else []
    finally:
        await procs.end(pid)
        await ctx.transport.run(["rm", "-f", key_path, log_path], timeout=30)
    run = Run(model.name, model.read_bytes, speeds, rpc_share(before, after, pid))
    if prompts:
        run.prompt_tokens, run.prompt_per_s = prompts[0][0], [speed for _, speed in prompts]
    share = ""
    if run.rpc_cpu_share is not None:
        share = (
            f"; the rpc-servers' share of the node's CPU time {run.rpc_cpu_share:.0%}: "
            f"{1000 * run.device_seconds_per_token:.2f} ms per token without llama-server beside them"
        )
    elif rpc_pids:
        share = "; the CPU time of the processes was not read or too short to split: the wall time counts"
    await ctx.log(
        f"{label}, {model.name} model ({model.read_bytes / 1e6:.0f} MB per token): "
        f"{1000 * run.seconds_per_token:.2f} ms per token "
        f"(samples of {tokens} tokens: {', '.join(f'{s:.1f}' for s in speeds)} tok/s){share}"
    )
    if prompts:
        await ctx.log(
            f"{label}, {model.name} model, a prompt of {run.prompt_tokens} tokens: "
            f"{', '.join(f'{s:.0f}' for s in run.prompt_per_s or [])} tokens/s, "
            f"{prompt_gflops(model, run) or 0:.1f} GFLOP/s"
        )
    return run


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


def _gbs(bps: float | None) -> float | None:
    return None if bps is None else round(bps / 1e9, 3)


async def _start_rpc_server(ctx, procs: Processes, build, host: str, port: int, device: str, workdir: str):
    log_path = posixpath.join(workdir, f"calibrate-{ctx.job.pk}-rpc-server-{port}.log")
    # Started as a deployment starts it (threads and their waiting, llamacpp/args.py), so what is measured
    # is what the plan will get.
    args = ["-H", host, "-p", str(port), "-d", device]
    args = quiet_rpc_server_args(args, node_cpu_threads(ctx.node.facts))
    pid = await procs.start(quiet_argv([build.rpc_server_path, *args], ctx.node.platform), log_path)
    await wait_listening(ctx, pid, port, log_path, timeout=30)
    return pid, log_path


async def _fixed_costs(
    ctx, procs: Processes, build, run, tiny: CalibrationModel, device: str, endpoint: str, workdir: str,
    cpu_pids: list[int], bandwidth_bps: float | None,
) -> FixedCosts:  # fmt: skip
    """The tiny model (its time is almost all fixed cost) inside llama-server alone, through this node's
    rpc-server, and through two rpc-servers (one block each, which turns on llama.cpp's pipeline
    parallelism): a pass, what a hop adds to it, and what splitting across servers adds beyond their hops.

    Under a CPU quota the hop is the rpc-server's own time (its share of the run, see
    `Run.device_seconds_per_token`) less its work on the tiny model's weights at the device's measured
    bandwidth (`bandwidth_bps`): llama-server's pass, on the same node here, is not part of it. `cpu_pids`
    (the rpc-server's PID, when its device is the CPU under a quota) asks for that split."""
    alone = await run(tiny, ["--device", "none", "-ngl", "0", "-t", "1", "--poll", "0"], "llama-server alone")
    through = ["--rpc", endpoint, "--device", "RPC0", "-ngl", "999"]
    one = await run(tiny, through, f"{device} through one", cpu_pids)
    second = 40000 + secrets.randbelow(20000)
    other_pid, _ = await _start_rpc_server(ctx, procs, build, "127.0.0.1", second, device, workdir)
    chain = ["--rpc", f"{endpoint},127.0.0.1:{second}", "--device", "RPC0,RPC1", "-ngl", "999", "-ts", "1,2"]
    two = await run(tiny, chain, f"{device} through two", [*cpu_pids, other_pid] if cpu_pids else [])
    await procs.end(other_pid)
    if one.rpc_cpu_share is None:
        hop = max(0.0, one.seconds_per_token - alone.seconds_per_token)
    else:
        compute = tiny.read_bytes / bandwidth_bps if bandwidth_bps else 0.0
        hop = max(0.0, one.device_seconds_per_token - compute)
    t_one, t_two = comparable(one, two)
    pipeline = max(0.0, t_two - t_one - hop)
    return FixedCosts(
        device=device,
        runs=[asdict(alone), asdict(one), asdict(two)],
        pass_ms=_ms(alone.seconds_per_token),
        hop_ms=_ms(hop),
        pipeline_ms=_ms(pipeline),
    )


async def calibrate_body(ctx) -> str:
    node = ctx.node
    if node is None:
        raise JobFailed("A calibration needs a node.")
    reason = await db(locked_refusal)(node)
    if reason:
        raise JobFailed(reason)
    build = await db(lambda: node.current_build)()
    devices = await db(lambda: sorted(node.devices.all(), key=lambda d: d.name != "CPU"))()
    port = node.rpc_port
    holders = await find_holders(ctx.transport, node.platform, port)
    if holders:
        raise JobFailed(
            f"RPC port {port} on {node.name} is held by {holders[0].describe()}; stop or reap it first."
        )
    models = await sync_to_async(prepared_models, thread_sensitive=False)()
    workdir = await run_dir(ctx)
    paths = await upload_models(ctx, models, posixpath.join(posixpath.dirname(workdir), "calibrate"))
    shallow, deep, tiny = models
    procs = Processes(ctx)
    results: dict = {
        "job": ctx.job.pk,
        "build": build.version,
        "devices": {},
        "fixed_costs": None,
        "local": None,
    }

    # Under a CPU quota llama-server's work, on the node here but on the coordinator in a deployment, spends
    # the rpc-server's quota: the CPU time of both is read to take it out (Run.device_seconds_per_token).
    # Only a quota below the cores can hold the two processes to it (a larger one never binds).
    facts = node.facts or {}
    quota = facts.get("cpu_quota_cores")
    quota_binds = bool(quota) and quota < (facts.get("cpu_cores") or float("inf"))

    async def run(
        model: CalibrationModel, placement: list[str], label: str, rpc_pids=(), prompt: bool = False
    ) -> Run:
        if "--rpc" in placement and "-t" not in placement:
            # The device under test does the work; llama-server, which a deployment runs on another
            # machine, stays out of its way: one thread and no busy-waiting (on a node with a CPU quota,
            # its spinning threads would spend the quota the rpc-server is measured by).
            placement = [*placement, "-t", "1", "--poll", "0"]
        return await timed_run(
            ctx,
            procs,
            build,
            paths[model.name],
            model,
            placement,
            workdir,
            label,
            rpc_pids=rpc_pids,
            prompt=prompt,
        )

    # The deep model, its context and compute buffers, and llama-server beside it on the same node.
    needed = int(1.5 * deep.size_bytes)
    small = [d for d in devices if d.free_bytes < needed]
    for device in small:
        await ctx.log(
            f"{device.name} has {device.free_bytes / 1e6:.0f} MB free; the calibration needs about "
            f"{needed / 1e6:.0f} MB: not measured (its figure stays as it was)"
        )
    devices = [d for d in devices if d.free_bytes >= needed]
    if not devices:
        raise JobFailed(
            f"No device of {node.name} has the {needed / 1e6:.0f} MB free that the calibration models need."
        )
    try:
        for device in devices:
            # Loopback only: llama-server, which drives the runs, is on the same node.
            rpc_pid, rpc_log = await _start_rpc_server(
                ctx, procs, build, "127.0.0.1", port, device.name, workdir
            )
            endpoint = f"127.0.0.1:{port}"
            through = ["--rpc", endpoint, "--device", "RPC0", "-ngl", "999"]
            label = f"{device.name} through ggml-rpc-server"
            # The quota holds the CPU's time, not a GPU's: only the CPU device's runs are split.
            cpu_pids = [rpc_pid] if quota_binds and device.name == "CPU" else []
            # The deep model also processes a prompt: the device's prompt throughput (issue 20).
            runs = [await run(model, through, label, cpu_pids, model is deep) for model in (shallow, deep)]
            line = fit(*runs)
            if results["fixed_costs"] is None:
                fixed = await _fixed_costs(
                    ctx,
                    procs,
                    build,
                    run,
                    tiny,
                    device.name,
                    endpoint,
                    workdir,
                    cpu_pids,
                    line.bandwidth_bps,
                )
                results["fixed_costs"] = asdict(fixed)
            await procs.end(rpc_pid)
            await ctx.transport.run(["rm", "-f", rpc_log], timeout=30)
            results["devices"][device.name] = {
                "runs": [asdict(r) for r in runs],
                "bandwidth_gbs": _gbs(line.bandwidth_bps),
                "overhead_ms": _ms(line.fixed_s),
                "prompt_gflops": prompt_gflops(deep, runs[1]),
                "prompt_tokens_per_s": runs[1].prompt_per_s,
            }
        if (node.may_coordinate or node.is_local) and "CPU" in results["devices"]:
            # A coordinator's own CPU computes inside llama-server (its threads, not an rpc-server's).
            alone = quiet_llama_server_args(["--device", "none", "-ngl", "0"], node_cpu_threads(node.facts))
            label = "CPU inside llama-server"
            local_runs = [await run(model, alone, label) for model in (shallow, deep)]
            local = fit(*local_runs)
            results["local"] = {
                "runs": [asdict(r) for r in local_runs],
                "bandwidth_gbs": _gbs(local.bandwidth_bps),
                "overhead_ms": _ms(local.fixed_s),
            }

        link_logs = []

        async def link_server(bind: str) -> int:
            pid, log_path = await _start_rpc_server(ctx, procs, build, bind, port, devices[0].name, workdir)
            link_logs.append(log_path)
            return pid

        link, results["link_protection"] = await calibrate_link.measure(ctx, node, procs, link_server)
        if link_logs:
            await ctx.transport.run(["rm", "-f", *link_logs], timeout=30)
    finally:
        await procs.end_all()
    results["link"] = asdict(link) if link else None
    results["coordinator_links"] = await calibrate_link.from_coordinators(ctx, node)
    summary = await db(store)(node, results)
    for line in summary:
        await ctx.log(line)
    return "; ".join(summary)
