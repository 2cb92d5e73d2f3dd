"""Why the split matters: the console's plan against llama.cpp's own splits on a mixed cluster.

On the network-namespace lab (tests/lab, needs root): a coordinator with little memory, a fast worker and a
worker held to --slow-quota percent of one core by the cgroup `cpu` controller. A generated model of about
--model-mib MiB lives on the coordinator. The console calibrates the three nodes (the calibrate job), plans
(planning/planner.py, from the node rows as the plan page does) and deploys through its own pages and
jobs (confirm and deploy buttons, then the deployment's steps over SSH). Then decode tokens/s is measured,
the same way for every variant, for

    (a) the console's plan                    (its deployment's llama-server)
    (b) llama.cpp's default split             same --rpc (both workers), no -ts, -ngl all, --fit off
    (c) llama.cpp's --fit on                  same --rpc, nothing else decided for it
    (d) the best -ts split in eighths         k,8-k between the two workers, k = 0..8

each at least --repeats times in alternation (a, b, c, d..., a, b, ...), and the medians compared. Every
variant's processes run as the console starts them (its thread counts from the probed cores and quota, its
short spin and `--poll 0`; llamacpp/args.py): only the split differs. With llama.cpp's own busy-polling the
coordinator's spinning threads would take CPU from the lab's workers, which share this machine's two cores
where real machines would not. Each decode speed is the median of DECODE_SAMPLES completions of TOKENS
tokens, as the console's measure step takes it; below each case the console's prediction for every -ts
split measured is printed beside it (the speed model checked on splits it did not choose). Case
"fits_fast": the model fits on the fast worker alone. Case "needs_both": a memory limit on the fast worker
(the model's weights and 8 MiB) leaves it no room for the whole model with its buffers, so the slow one must
take part (the sweep's -ts 8,0 checks that: it must not load). There, in the first round, every variant
first gets a prompt that fills the context (a whole ubatch, the most of its compute buffer a CPU worker
ever writes): a split that loads and decodes short prompts but gets the fast worker OOM-killed by the first
long one is not a split an expert would keep, so the sweep leaves it out (and says so), and the plan must
survive it.

    .venv/bin/python benchmarks/split_speed.py [--slow-quota 10] [--model-mib 360] [--repeats 3]
                                               [--case fits_fast|needs_both|both|moe] [--rpc-mode direct]
                                               [--slow-cpus N] [--busy desk|fast|slow]

Case "moe" (issue 19): a generated mixture of experts (llama.cpp's `llama` architecture, eight experts of
which a token reads two; --model-mib, default 300, of which the routed experts are nine tenths) on the same
mixed cluster. The fast worker has room for every block's attention and the output layer and about
MOE_FAST_EXPERT_SHARE of the experts, the coordinator for the experts of about one block beside
llama-server, the slow worker for everything. The hand sweep is what an expert would try: `-ts` in eighths
as above, then `--n-cpu-moe N` (the experts of the first N blocks in the coordinator's memory) with the
round's best -ts and the next eighth toward the fast worker, for every N whose experts fit the
coordinator's memory as its probe reports it (the lab's coordinator maps the model from a page cache that
another cgroup already paid for, so an N that would not fit a real laptop's memory still loads here: it is
left out, and said so). The plan must survive a prompt that fills the context, as in needs_both.

Mixes whose slowness is not a quota: `--slow-cpus N` keeps the slow worker on N of this machine's cores by a
cgroup v1 cpuset (the last N; no CPU quota, so each core runs at full speed: on this two-core machine a
one-core worker is slow by having fewer cores than the others, which share both); `--busy NODE` starts a CPU
burner (`python -c 'while 1: pass'`) inside that lab host's namespace and cgroups before the nodes are
probed and calibrated, and ends it by its PID when the benchmark ends: a machine that is busy all along, as
the calibration sees it too.

The plan is deployed in direct RPC mode by default, as llama.cpp's own variants are run (their llama-server
reaches the rpc-servers on the workers' LAN addresses): what is compared is the split, not the transport.
`--rpc-mode tunnel` deploys the plan through the console's SSH tunnels instead (benchmarks/rpc_modes.py
measures what they cost on their own).

Targets: fits_fast at least 3x the default split, needs_both at least 1.3x; on both the plan within 10% of
the sweep's best, never slower than the better of (b) and (c), and the prediction within 25% of measured.
This machine's two cores are shared by the lab hosts (and whatever else runs on it), so the numbers move
with the machine's load: the script prints every sample. Ends with one JSON line:
{"cases": [{"name", "plan_tps", "default_tps", "fit_tps", "sweep_best_tps", "ratio_default", "ratio_fit",
"ratio_sweep", "pred_err", "predicted_tps", "sweep_best", "sweep_ratio_default", "load"}, ...], "mix": {...},
"load": [1, 5, 15 min]}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
WORKDIR = Path(tempfile.mkdtemp(prefix="ramdeck-split-"))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ramdeck_site.settings")
os.environ["DATABASE_URL"] = f"sqlite:///{WORKDIR / 'console.sqlite3'}"
os.environ["RAMDECK_VAR_DIR"] = str(WORKDIR / "var")
os.environ["ALLOWED_HOSTS"] = "testserver,localhost"
# A llama-server that aborts (a worker OOM-killed under it) would otherwise attach gdb for a backtrace, inside
# the coordinator's memory limit: gdb is OOM-killed and leaves llama-server stopped, the request hanging.
os.environ["GGML_NO_BACKTRACE"] = "1"

import django

django.setup()

import httpx
from django.conf import settings
from django.core.management import call_command
from django.test import Client
from django.urls import reverse

# Job log lines go to the database; nobody watches them live here.
settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}

from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment, DeploymentState
from jobs.models import Job, JobState
from jobs.runner import run_job
from llamacpp.args import node_cpu_threads, quiet_argv, quiet_llama_server_args, quiet_rpc_server_args
from llamacpp.gguf import profile_path
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import Node
from nodes.pool import planner_nodes
from planning import manual, planner
from planning.costs import evaluate, expert_bytes_per_block
from tests.deploy_fixtures import lab_node, listeners_in, route_between
from tests.factories import UserFactory
from tests.lab.netlab import Lab, LabHost, cleanup_leftovers, kill_pid
from tests.llamacpp_build import require_llamacpp
from tests.runs import run_deployment, run_stop

MIB = 2**20
RPC_PORT = 50052
LLAMA_PORT = 8080
CTX = 512
# Each variant's decode speed: the median of DECODE_SAMPLES completions of TOKENS tokens, as the console's own
# measure step takes it (deployments/steps/checks.py). Not the best of a few short ones: under a CPU quota a
# completion is sped up as well as slowed (where its tokens fall in the quota's periods); one deployment of
# needs_both at 10% of a core decoded 17.5 to 27.8 tok/s in nine completions in a row (48 to 256 tokens).
TOKENS = 128
DECODE_SAMPLES = 3
# The coordinator has little memory to spare (a laptop busy with other work): llama-server and its compute
# buffers fit, not one block of the model beside them, so the model goes to the workers.
COORDINATOR_MIB = 72
# needs_both: the fast worker's memory limit is the model's weights and this much more: not enough for the
# whole model with its buffers (the sweep's -ts 8,0 shows whether it really is not), enough for most of it.
FAST_HEADROOM_MIB = 8
WIDTH = {"n_embd": 1536, "n_head": 12, "n_head_kv": 4, "n_ff": 4096, "n_ctx_train": 2048}
BLOCK_BYTES = 2 * (2 * 1536 * 1536 + 2 * 1536 * 512 + 3 * 1536 * 4096)  # f16 weights of one block: 50 MB
# The moe case: eight experts of n_ff 1024, two per token; per block 48 MiB of routed experts (a token reads
# 12) and 5 MiB of attention and router, which every token reads.
MOE_WIDTH = {"n_embd": 1024, "n_head": 8, "n_head_kv": 2, "n_ff": 1024, "n_ctx_train": 2048,
             "n_expert": 8, "n_expert_used": 2}  # fmt: skip
MOE_BLOCK_BYTES = 2 * (2 * 1024 * 1024 + 2 * 1024 * 256 + 8 * 1024 + 3 * 8 * 1024 * 1024)
# The share of the experts the fast worker has room for beside every block's attention and the output.
MOE_FAST_EXPERT_SHARE = 0.6
# The coordinator's room for experts beside llama-server, in blocks' worth of experts.
MOE_COORDINATOR_EXPERT_BLOCKS = 1.5


def say(text: str) -> None:
    print(text, flush=True)


@dataclass
class Cluster:
    lab: Lab
    coordinator_host: LabHost
    fast_host: LabHost
    slow_host: LabHost
    operator: object = None
    nodes: dict[str, Node] = field(default_factory=dict)
    model: ModelFile | None = None
    rpc_procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    firewall: list[list[str]] = field(default_factory=list)
    burner: subprocess.Popen | None = None
    calibrated: set[str] = field(default_factory=set)

    @property
    def workers(self) -> list[tuple[str, LabHost]]:
        return [("fast", self.fast_host), ("slow", self.slow_host)]

    def node(self, name: str) -> Node:
        return Node.objects.get(pk=self.nodes[name].pk)


# --------------------------------------------------------------------------------------------------
# The cluster, through the console
# --------------------------------------------------------------------------------------------------


def run_inline(kind: str, node: Node, **params) -> Job:
    job = Job.objects.create(kind=kind, node=node, title=f"{kind} {node.name}", params=params)
    run_job(job.pk)
    job.refresh_from_db()
    if job.state != JobState.SUCCEEDED:
        tail = "\n".join(job.log_lines.order_by("-seq").values_list("text", flat=True)[:15][::-1])
        raise SystemExit(f"{kind} on {node.name} {job.state}: {job.result}\n{tail}")
    return job


def allow_forwarding(cluster: Cluster) -> None:
    """A firewall that drops forwarded packets (dockerd sets one) would cut the lab hosts off each other:
    accept the lab's own veths while the benchmark runs (removed at the end)."""
    if not shutil.which("iptables"):
        return
    for host in (cluster.coordinator_host, cluster.fast_host, cluster.slow_host):
        for direction in ("-i", "-o"):
            rule = ["FORWARD", direction, host.veth_host, "-j", "ACCEPT"]
            if subprocess.run(["iptables", "-I", *rule], capture_output=True).returncode == 0:
                cluster.firewall.append(rule)


def build_cluster(
    lab: Lab,
    slow_quota: float,
    model_mib: int,
    *,
    slow_cpus: int = 0,
    moe: bool = False,
    quota_period_ms: float = 10.0,
) -> Cluster:
    hosts = [lab.add_host() for _ in range(3)]
    cluster = Cluster(lab, *hosts)
    route_between(hosts)
    allow_forwarding(cluster)
    if slow_cpus:
        # Fewer cores, each at full speed, and no quota: the last `slow_cpus` of this machine's.
        cpus = sorted(os.sched_getaffinity(0))[-slow_cpus:]
        lab.pin_cpus(cluster.slow_host, cpus)
        slowness = f"slow worker on CPU {','.join(map(str, cpus))} (cpuset, no quota)"
    else:
        # A short quota period (10 ms by default): the slow worker is slower all the time, as an old PC is,
        # rather than fast in bursts with 100 ms pauses (a quota'd container), which no speed per byte
        # describes. The kernel's smallest quota is 1 ms, so the period is at least 1 ms / the quota.
        group = lab.throttle_cpu(cluster.slow_host, slow_quota, period_us=round(quota_period_ms * 1000))
        period_ms = int((group / "cpu.cfs_period_us").read_text()) / 1000
        slowness = f"slow worker at {slow_quota:.0%} of a core, in periods of {period_ms:g} ms"
    cluster.operator = UserFactory(username="oscar-operator", role="operator")
    binaries = require_llamacpp()
    for name, host in (
        ("desk", cluster.coordinator_host),
        ("fast", cluster.fast_host),
        ("slow", cluster.slow_host),
    ):
        node = lab_node(lab, host, name=name, may_coordinate=name == "desk")
        run_inline("build", node, source="existing", path=str(binaries.rpc_server.parent))
        cluster.nodes[name] = node
    if moe:
        layers = max(2, round(model_mib * MIB / MOE_BLOCK_BYTES))
        spec = TinyLlama(n_layer=layers, seed=42, **MOE_WIDTH)
    else:
        layers = max(2, round(model_mib * MIB / BLOCK_BYTES))
        spec = TinyLlama(n_layer=layers, seed=42, **WIDTH)
    path = write_tiny_llama(WORKDIR / "split.gguf", spec)
    profile = profile_path(path)
    cluster.model = ModelFile.objects.create(
        name="split",
        node=cluster.nodes["desk"],
        path=str(path),
        size_bytes=profile["size_bytes"],
        profile=profile,
    )
    size = profile["size_bytes"] / MIB
    kind = "a mixture of experts (8 experts, 2 a token)" if moe else "dense"
    say(f"model: {kind}, {layers} blocks, {size:.0f} MiB; {slowness}")
    return cluster


def start_burner(cluster: Cluster, node: str) -> None:
    """A CPU burner on the lab host of `node`, in its namespace and cgroups (as if started over its sshd)."""
    host = {"desk": cluster.coordinator_host, "fast": cluster.fast_host, "slow": cluster.slow_host}[node]
    argv = host.limited_argv([sys.executable, "-c", "while 1: pass"])
    cluster.burner = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    say(f"CPU burner on {node} (pid {cluster.burner.pid})")


def stop_burner(cluster: Cluster) -> None:
    if cluster.burner is not None:
        kill_pid(cluster.burner.pid)
        cluster.burner.wait()
        cluster.burner = None


def probe_and_calibrate(cluster: Cluster) -> None:
    """Probe every node, then calibrate the ones whose figures are not a fresh measurement of what the probe
    now sees. One after the other: the lab hosts share this machine's two cores, and two calibrations at
    once would slow each other down (no two real machines do)."""
    for name in cluster.nodes:
        run_inline("probe", cluster.node(name))
    for name in cluster.nodes:
        node = cluster.node(name)
        # Once per run: a figure calibration could not measure (a busy node's, "too fast to tell apart")
        # stays a guess, and after the memory limits a node may have no room for the calibration models.
        if name in cluster.calibrated or all(d.measurement_state == "fresh" for d in node.devices.all()):
            continue
        cluster.calibrated.add(name)
        started = time.monotonic()
        job = run_inline("calibrate", node)
        say(f"calibrated {name} in {time.monotonic() - started:.0f} s: {job.result}")


# --------------------------------------------------------------------------------------------------
# Timing a llama-server
# --------------------------------------------------------------------------------------------------


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 300) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    return False


def decode_speed(url: str, key: str = "") -> float:
    """tokens/s: the median of DECODE_SAMPLES completions of TOKENS tokens after a short warm-up, the same
    for every variant."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"prompt": "The quick brown fox", "cache_prompt": False, "ignore_eos": True}
    httpx.post(f"{url}/completion", json={**body, "n_predict": 4}, headers=headers, timeout=600)
    speeds = []
    for _ in range(DECODE_SAMPLES):
        answer = httpx.post(
            f"{url}/completion", json={**body, "n_predict": TOKENS}, headers=headers, timeout=600
        )
        answer.raise_for_status()
        speeds.append(float(answer.json()["timings"]["predicted_per_second"]))
    return statistics.median(speeds)


def survives_full_prompt(url: str, key: str = "") -> bool:
    """Whether llama-server answers a prompt that fills the context (CTX less a few tokens for the answer):
    a worker that runs out of memory on it is OOM-killed, and llama-server with it."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = "".join(chr(97 + (i * 7) % 26) for i in range(4 * CTX))
    try:
        tokens = httpx.post(f"{url}/tokenize", json={"content": text}, headers=headers, timeout=60)
        body = {"prompt": tokens.json()["tokens"][: CTX - 12], "n_predict": 4, "cache_prompt": False}
        answer = httpx.post(f"{url}/completion", json=body, headers=headers, timeout=1200)
        return answer.status_code == 200 and answer.json()["timings"]["prompt_n"] >= CTX - 12
    except (httpx.HTTPError, ValueError, KeyError):
        return False


def node_facts(cluster: Cluster, name: str) -> dict:
    """What the console's probe found on a lab node (its cores and CPU quota), from the database."""
    return cluster.node(name).facts or {}


def start_rpc_servers(cluster: Cluster) -> None:
    """ggml-rpc-server on each worker, inside its cgroups (as if started over its sshd), unless running."""
    rpc = require_llamacpp().rpc_server
    for name, host in cluster.workers:
        proc = cluster.rpc_procs.get(name)
        if proc is not None and proc.poll() is None:
            continue
        # The console's threads and waiting for its rpc-servers: what differs between variants is the split.
        args = quiet_rpc_server_args(
            ["-H", host.address, "-p", str(RPC_PORT)], node_cpu_threads(node_facts(cluster, name))
        )
        argv = host.limited_argv(quiet_argv([str(rpc), *args]))
        log = open(WORKDIR / f"rpc-{name}.log", "a")  # noqa: SIM115 - the process writes it until it ends
        cluster.rpc_procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not listeners_in(host, RPC_PORT):
            if time.monotonic() > deadline or cluster.rpc_procs[name].poll() is not None:
                raise SystemExit(f"ggml-rpc-server on the {name} worker did not start")
            time.sleep(0.2)


def stop_rpc_servers(cluster: Cluster) -> None:
    for proc in cluster.rpc_procs.values():
        if proc.poll() is None:
            kill_pid(proc.pid)
        proc.wait()
    cluster.rpc_procs.clear()


def llama_run(cluster: Cluster, extra: list[str], *, full_prompt: bool = False) -> float | None:
    """llama-server on the coordinator with both workers in --rpc and `extra`; its decode speed, or None when
    it could not load (a worker ran out of memory) or, with `full_prompt`, did not survive a prompt that
    fills the context."""
    start_rpc_servers(cluster)
    server = require_llamacpp().llama_server
    host = cluster.coordinator_host
    rpc = ",".join(f"{h.address}:{RPC_PORT}" for _, h in cluster.workers)
    # The console's waiting and thread count on the coordinator (as its deployment runs llama-server): with
    # llama.cpp's own busy-polling, the coordinator's spinning threads take CPU from the lab's workers, which
    # share this machine's cores (on separate machines they would not), and the split would be compared
    # with a handicap that is not the split's.
    extra = quiet_llama_server_args(extra, node_cpu_threads(node_facts(cluster, "desk")))
    argv = quiet_argv(
        [str(server), "-m", cluster.model.path, "--rpc", rpc, "-c", str(CTX), "-np", "1", *extra]
    )
    argv += ["--host", host.address, "--port", str(LLAMA_PORT)]
    log = open(WORKDIR / "llama-server.log", "w")  # noqa: SIM115 - the process writes it until it ends
    proc = subprocess.Popen(host.limited_argv(argv), stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://{host.address}:{LLAMA_PORT}"
        if not wait_healthy(url, proc):
            return None
        if full_prompt and not survives_full_prompt(url):
            # A worker (or llama-server) was OOM-killed: the next run needs fresh rpc-servers.
            stop_rpc_servers(cluster)
            return None
        return decode_speed(url)
    except httpx.HTTPError:
        return None
    finally:
        kill_pid(proc.pid)
        proc.wait()
        log.close()


# --------------------------------------------------------------------------------------------------
# The plan, through the console's pages
# --------------------------------------------------------------------------------------------------


def confirm_plan(cluster: Cluster, client: Client, rpc_mode: str) -> Deployment:
    nodes = [cluster.nodes[name].pk for name in ("desk", "fast", "slow")]
    form = {"full": 1, "ctx": CTX, "parallel": 1, "cache_type": "f16", "clamp": 0.7,
            "coordinator": cluster.nodes["desk"].pk, "nodes": nodes, "name": "split"}  # fmt: skip
    response = client.post(reverse("deployments:confirm", args=[cluster.model.pk]), form)
    if response.status_code != 302:
        raise SystemExit(f"the plan was not confirmed ({response.status_code}): {response.content[:2000]!r}")
    deployment = Deployment.objects.get(pk=int(response.url.rstrip("/").rsplit("/", 1)[1]))
    client.post(reverse("deployments:rpc_mode", args=[deployment.pk]), {"mode": rpc_mode})
    deployment.refresh_from_db()
    if deployment.rpc_mode != rpc_mode:
        raise SystemExit(f"the deployment's RPC mode is {deployment.rpc_mode}, not {rpc_mode}")
    return deployment


def plan_run(
    cluster: Cluster,
    client: Client,
    previous: Deployment | None,
    *,
    full_prompt: bool = False,
    rpc_mode: str = "direct",
) -> tuple[float, Deployment]:
    """Deploy the plan through the console (confirm, deploy, then its steps over SSH), time it, stop it.
    With `full_prompt`, a prompt that fills the context first: the plan must survive it."""
    stop_rpc_servers(cluster)
    queued: list[tuple[str, int]] = []
    lifecycle._enqueue = lambda task, pk: queued.append((task, pk))
    if previous is None:
        deployment = confirm_plan(cluster, client, rpc_mode)
        client.post(reverse("deployments:deploy", args=[deployment.pk]))
    else:
        deployment, started, message = lifecycle.redeploy(previous, cluster.operator)
        if not started:
            raise SystemExit(f"redeploy refused: {message}")
    run_deployment(deployment.pk)
    deployment.refresh_from_db()
    if deployment.state == DeploymentState.FAILED:
        # Seen once at a load average of 11: the verify step's grep of llama-server's log came back empty.
        # What is timed here is the plan's speed, so one more deployment, said aloud.
        say(f"the deployment failed ({deployment.failed_step}: {deployment.state_reason[:300]}); once more")
        deployment, started, message = lifecycle.redeploy(deployment, cluster.operator)
        if not started:
            raise SystemExit(f"redeploy refused: {message}")
        run_deployment(deployment.pk)
        deployment.refresh_from_db()
    if deployment.state != DeploymentState.RUNNING:
        raise SystemExit(
            f"the deployment {deployment.state}: {deployment.failed_step}: {deployment.state_reason}"
        )
    coordinator = cluster.coordinator_host
    url = f"http://{coordinator.address}:{deployment.port}"
    if full_prompt and not survives_full_prompt(url, deployment.api_key()):
        plan = describe_plan(deployment.plan)
        raise SystemExit(f"the plan's deployment did not survive a prompt of {CTX} tokens: {plan}")
    speed = decode_speed(url, deployment.api_key())
    lifecycle.stop_deployment(deployment, cluster.operator)
    run_stop(deployment.pk)
    deployment.refresh_from_db()
    if deployment.state != DeploymentState.STOPPED:
        raise SystemExit(f"the deployment did not stop: {deployment.state_reason}")
    return speed, deployment


# --------------------------------------------------------------------------------------------------
# One case
# --------------------------------------------------------------------------------------------------


def describe_plan(plan: dict) -> str:
    """Each device's blocks (+out for the output layer), and for a mixture of experts placed apart the
    blocks whose experts it holds (x...)."""
    parts = []
    for p in plan["placements"]:
        text = f"{p['node']}/{p['device']} {p['layers']}{'+out' if p['output_layer'] else ''}"
        experts = p.get("expert_blocks") or []
        if plan.get("places_experts") and experts:
            text += f" x{','.join(map(str, experts))}"
        if p["layers"] or p["output_layer"] or (plan.get("places_experts") and experts):
            parts.append(text)
    return ", ".join(parts)


def fast_limit(profile: dict) -> int:
    """Memory for the fast worker in needs_both: the weights it would hold with the whole model (every block
    and the output layer) and FAST_HEADROOM_MIB, less than that plus an rpc-server and its buffers."""
    return int(sum(profile["block_weight_bytes"]) + profile["output_bytes"]) + FAST_HEADROOM_MIB * MIB


def moe_fast_limit(profile: dict) -> int:
    """Memory for the fast worker in the moe case: every block's attention and the output layer, about
    MOE_FAST_EXPERT_SHARE of the experts, and FAST_HEADROOM_MIB for its buffers."""
    experts = sum(expert_bytes_per_block(profile))
    dense = sum(profile["block_weight_bytes"]) - experts + profile["output_bytes"]
    return int(dense + MOE_FAST_EXPERT_SHARE * experts) + 4 * FAST_HEADROOM_MIB * MIB


def moe_coordinator_limit(profile: dict) -> int:
    """Memory for the coordinator in the moe case: llama-server and the experts of about
    MOE_COORDINATOR_EXPERT_BLOCKS blocks."""
    block = max(expert_bytes_per_block(profile))
    return COORDINATOR_MIB * MIB + int(MOE_COORDINATOR_EXPERT_BLOCKS * block)


def cpu_moe_blocks_that_fit(profile: dict) -> int:
    """The largest --n-cpu-moe whose experts fit the coordinator's memory beside llama-server."""
    block = max(expert_bytes_per_block(profile))
    return int((moe_coordinator_limit(profile) - COORDINATOR_MIB * MIB) // block)


def run_case(cluster: Cluster, client: Client, name: str, repeats: int, rpc_mode: str) -> dict:
    probe_and_calibrate(cluster)
    samples: dict[str, list[float]] = {"plan": [], "default": [], "fit": []}
    # The hand sweep by label: -ts k,8-k first, then (moe) --n-cpu-moe with the best of those.
    variants: dict[str, list[str]] = {
        f"-ts {k},{8 - k}": ["-ngl", "999", "--fit", "off", "-ts", f"{k},{8 - k}"] for k in range(9)
    }
    sweep: dict[str, list[float]] = {label: [] for label in variants}
    deployment = None
    too_big: set[int] = set()
    left_out: set[str] = set()
    # Only where a worker has a memory limit (needs_both, moe): the coordinator's own limit is the same for
    # all.
    check_full = name in ("needs_both", "moe")
    survived: dict[str, bool] = {}
    for round_no in range(1, repeats + 1):
        full = check_full and round_no == 1
        speed, deployment = plan_run(cluster, client, deployment, full_prompt=full, rpc_mode=rpc_mode)
        if full:
            survived["plan"] = True
        samples["plan"].append(speed)
        if round_no == 1:
            plan = deployment.plan
            baseline = plan["baseline"]["predicted_tokens_per_s"] or 0
            say(f"[{name}] plan ({rpc_mode} RPC): {describe_plan(plan)}; predicted "
                f"{plan['predicted_tokens_per_s']:.1f} tok/s (default split predicted {baseline:.1f}); "
                f"per token {plan['speed_model']}")  # fmt: skip
        say(f"[{name}] round {round_no} (a) plan {speed:.1f} tok/s (the console measured "
            f"{deployment.measured_decode_tps:.1f})")  # fmt: skip
        for variant, extra in (("default", ["-ngl", "999", "--fit", "off"]), ("fit", ["--fit", "on"])):
            value = llama_run(cluster, extra, full_prompt=full)
            if full:
                survived[variant] = value is not None
                if value is None:
                    # llama.cpp's own split lost a worker to a long prompt; still timed on short ones.
                    say(f"[{name}] ({variant}) does not survive a prompt of {CTX} tokens")
                    value = llama_run(cluster, extra)
            if value is None:
                raise SystemExit(f"[{name}] the {variant} split did not load; see {WORKDIR}/llama-server.log")
            samples[variant].append(value)
            say(f"[{name}] round {round_no} ({variant}) {value:.1f} tok/s")
        for label, extra in list(variants.items()):
            k = int(label.split()[1].split(",")[0]) if label.startswith("-ts") else None
            if k is not None and k in too_big or label in left_out:
                continue
            value = llama_run(cluster, extra, full_prompt=full)
            if value is None:
                why = f"does not load{f' or survive a prompt of {CTX} tokens' if full else ''}"
                say(f"[{name}] round {round_no} (sweep) {label} {why} (out of memory)")
                if k is not None:
                    # The fast worker ran out of memory: every larger share for it does too.
                    too_big.update(range(k, 9))
                else:
                    left_out.add(label)
                continue
            sweep[label].append(value)
            say(f"[{name}] round {round_no} (sweep) {label} {value:.1f} tok/s")
        if name == "moe" and round_no == 1:
            add_cpu_moe_variants(cluster, variants, sweep, left_out, name)
            for label, extra in variants.items():
                if label.startswith("--n-cpu-moe") and label not in left_out and not sweep[label]:
                    value = llama_run(cluster, extra, full_prompt=full)
                    if value is None:
                        say(f"[{name}] round {round_no} (sweep) {label} does not load (out of memory)")
                        left_out.add(label)
                        continue
                    sweep[label].append(value)
                    say(f"[{name}] round {round_no} (sweep) {label} {value:.1f} tok/s")
    stop_rpc_servers(cluster)
    medians = {key: statistics.median(values) for key, values in samples.items()}
    sweep_medians = {k: statistics.median(v) for k, v in sweep.items() if v}
    best_k = max(sweep_medians, key=sweep_medians.get)
    predicted = deployment.plan["predicted_tokens_per_s"]
    load = os.getloadavg()
    result = {
        "name": name,
        "plan_tps": round(medians["plan"], 2),
        "default_tps": round(medians["default"], 2),
        "fit_tps": round(medians["fit"], 2),
        "sweep_best_tps": round(sweep_medians[best_k], 2),
        "ratio_default": round(medians["plan"] / medians["default"], 3),
        "ratio_fit": round(medians["plan"] / medians["fit"], 3),
        "ratio_sweep": round(medians["plan"] / sweep_medians[best_k], 3),
        "pred_err": round(abs(predicted - medians["plan"]) / medians["plan"], 3),
        "predicted_tps": round(predicted, 2),
        "sweep_best": best_k,
        # How much the mix allows: the best hand split's own ratio to llama.cpp's default.
        "sweep_ratio_default": round(sweep_medians[best_k] / medians["default"], 3),
        "plan": describe_plan(deployment.plan),
        "load": [round(x, 2) for x in load],
    }
    if check_full:
        result["survives_full_prompt"] = survived
        result["sweep_left_out"] = sorted([f"-ts {k},{8 - k}" for k in too_big] + list(left_out))
    say(f"\n[{name}] medians over {repeats} rounds (tokens/s):")
    say(f"  (a) console's plan        {medians['plan']:8.1f}   predicted {predicted:.1f}, "
        f"error {result['pred_err']:.0%}")  # fmt: skip
    say(f"  (b) llama.cpp default     {medians['default']:8.1f}   plan is {result['ratio_default']:.2f}x")
    say(f"  (c) llama.cpp --fit on    {medians['fit']:8.1f}   plan is {result['ratio_fit']:.2f}x")
    say(f"  (d) best {best_k:<18} {sweep_medians[best_k]:8.1f}   plan is {result['ratio_sweep']:.2f}x "
        f"(the best sweep is {result['sweep_ratio_default']:.2f}x the default)")  # fmt: skip
    say("  sweep: " + ", ".join(f"{k} {v:.1f}" for k, v in sweep_medians.items()))
    if name != "moe":
        predictions = sweep_predictions(cluster, deployment)
        errors = {k: (predictions[k] - v) / v for k, v in sweep_medians.items() if k in predictions}
        say("  sweep predicted: " + ", ".join(
            f"{k} {predictions[k]:.1f} ({errors[k]:+.0%})" for k in sweep_medians if k in predictions
        ))  # fmt: skip
        result["sweep_predicted_tps"] = {k: round(predictions[k], 2) for k in errors}
        result["sweep_pred_err_median"] = round(statistics.median(abs(e) for e in errors.values()), 3)
    say(f"  load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if name == "needs_both" and "-ts 8,0" in sweep_medians:
        say("  NOTE: the whole model loaded on the fast worker (-ts 8,0): this case is not what it claims")
    return result


def ts_layers(n_layer: int, k: int) -> tuple[int, int] | None:
    """Blocks per worker under llama.cpp's `-ts k,8-k -ngl 999` (llama_model's split points: layer il goes to
    the first device whose cumulative share exceeds il / (n_layer + 1), the output layer counting as layer
    n_layer), or None when the output layer would land on a worker with no block (the console's splits keep
    it with the last blocks, so it has no price for that)."""
    shares = [k / 8, 1.0]
    layers = range(n_layer + 1)
    devices = [next(d for d, edge in enumerate(shares) if il / (n_layer + 1) < edge) for il in layers]
    counts = (devices[:n_layer].count(0), devices[:n_layer].count(1))
    last_with_blocks = 1 if counts[1] else 0
    return counts if devices[n_layer] == last_with_blocks else None


def sweep_predictions(cluster: Cluster, deployment: Deployment) -> dict[str, float]:
    """The console's predicted tokens/s for each dense `-ts k,8-k` split of the sweep, priced by the same
    model and calibration as the plan (planning/manual.py, the split-by-hand form's pricing): the speed model
    checked on every split measured, not only on the one it chose."""
    rows = [cluster.node("desk"), cluster.node("fast"), cluster.node("slow")]
    settings = planner.Settings(**deployment.plan["settings"])
    problem = planner.build_problem(cluster.model.profile, planner_nodes(rows[1:], rows[0]), settings)
    devices = manual.manual_devices(problem, [(name, "CPU") for name, _ in cluster.workers])
    n_layer = len(problem.block_bytes)
    out = {}
    for k in range(9):
        counts = ts_layers(n_layer, k)
        if counts is None:
            continue
        split = manual.manual_split(problem, devices, [0, *counts])
        out[f"-ts {k},{8 - k}"] = 1.0 / evaluate(problem, split).seconds_per_token
    return out


def add_cpu_moe_variants(
    cluster: Cluster, variants: dict, sweep: dict, left_out: set[str], name: str
) -> None:
    """--n-cpu-moe N with the first round's best -ts and the next eighth toward the fast worker (the
    experts moved to the coordinator leave it room for more), for every N up to the blocks whose experts
    fit the coordinator's memory; one N beyond, to say it is left out."""
    profile = cluster.model.profile
    done = {label: v[0] for label, v in sweep.items() if v and label.startswith("-ts")}
    if not done:
        return
    best = int(max(done, key=done.get).split()[1].split(",")[0])
    fits = cpu_moe_blocks_that_fit(profile)
    for n in range(1, fits + 2):
        for k in sorted({best, min(8, best + 1)}):
            label = f"--n-cpu-moe {n} -ts {k},{8 - k}"
            variants[label] = ["-ngl", "999", "--fit", "off", "-ts", f"{k},{8 - k}", "--n-cpu-moe", str(n)]
            sweep[label] = []
            if n > fits:
                left_out.add(label)
                say(f"[{name}] (sweep) {label} left out: the experts of {n} blocks do not fit the "
                    f"coordinator's {moe_coordinator_limit(profile) / MIB:.0f} MiB")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--slow-quota", type=float, default=10.0, help="slow worker's CPU quota, percent of a core"
    )
    parser.add_argument(
        "--model-mib", type=int, default=None, help="size of the generated model in MiB (360; moe: 300)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every variant (at least 3)")
    parser.add_argument("--case", choices=["fits_fast", "needs_both", "both", "moe"], default="both")
    parser.add_argument(
        "--slow-cpus", type=int, default=0, help="slow worker on this many cores by a cpuset, no quota"
    )
    parser.add_argument("--busy", choices=["desk", "fast", "slow"], help="a CPU burner on this node")
    parser.add_argument(
        "--quota-period-ms", type=float, default=10.0,
        help="the slow worker's quota period (10; 1 gives the shortest the kernel allows: 1 ms of quota)",
    )  # fmt: skip
    parser.add_argument(
        "--rpc-mode", choices=["direct", "tunnel"], default="direct", help="how the plan's deployment reaches"
        " the rpc-servers (llama.cpp's own variants always go direct)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.model_mib is None:
        args.model_mib = 300 if args.case == "moe" else 360
    if not 1 <= args.slow_quota <= 100 or args.model_mib < 32 or args.repeats < 1:
        parser.error("--slow-quota must be 1..100, --model-mib at least 32, --repeats at least 1")
    cores = len(os.sched_getaffinity(0))
    if not 0 <= args.slow_cpus < cores:
        parser.error(f"--slow-cpus must be 1..{cores - 1} (this machine has {cores} cores)")
    mix = {"slow_quota": None if args.slow_cpus else args.slow_quota / 100,
           "quota_period_ms": None if args.slow_cpus else args.quota_period_ms,
           "slow_cpus": args.slow_cpus or None, "busy": args.busy}  # fmt: skip
    call_command("migrate", verbosity=0)
    cleanup_leftovers()
    lab = Lab()
    cluster = None
    try:
        cluster = build_cluster(
            lab,
            args.slow_quota / 100,
            args.model_mib,
            slow_cpus=args.slow_cpus,
            moe=args.case == "moe",
            quota_period_ms=args.quota_period_ms,
        )
        if args.busy:
            start_burner(cluster, args.busy)
        probe_and_calibrate(cluster)
        # Calibrated first (the calibration models would not fit beside llama-server in what is left),
        # then the coordinator's memory shrinks to what a busy laptop has free. A memory limit changes what
        # fits, not how fast a device is: the calibration stays valid.
        coordinator_limit = COORDINATOR_MIB * MIB
        if args.case == "moe":
            coordinator_limit = moe_coordinator_limit(cluster.model.profile)
        lab.limit_memory(cluster.coordinator_host, coordinator_limit)
        client = Client()
        client.force_login(cluster.operator)
        cases = []
        if args.case in ("fits_fast", "both"):
            cases.append(run_case(cluster, client, "fits_fast", args.repeats, args.rpc_mode))
        if args.case in ("needs_both", "both"):
            limit = fast_limit(cluster.model.profile)
            lab.limit_memory(cluster.fast_host, limit)
            say(f"\nfast worker limited to {limit / MIB:.0f} MiB")
            cases.append(run_case(cluster, client, "needs_both", args.repeats, args.rpc_mode))
        if args.case == "moe":
            limit = moe_fast_limit(cluster.model.profile)
            lab.limit_memory(cluster.fast_host, limit)
            coordinator_mib = coordinator_limit / MIB
            say(f"\nfast worker limited to {limit / MIB:.0f} MiB, coordinator to {coordinator_mib:.0f}")
            cases.append(run_case(cluster, client, "moe", args.repeats, args.rpc_mode))
    finally:
        if cluster is not None:
            stop_burner(cluster)
            stop_rpc_servers(cluster)
            for rule in cluster.firewall:
                subprocess.run(["iptables", "-D", *rule], capture_output=True)
        lab.close()
        shutil.rmtree(WORKDIR, ignore_errors=True)
    load = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps({"rpc_mode": args.rpc_mode, "mix": mix, "load": load, "cases": cases}))


if __name__ == "__main__":
    main()
