"""The bytes a deploy sends to a worker, cold and warm, counted on the worker's link in the lab.

Two lab hosts over real sshd: a coordinator and a worker whose rpc-server the console starts with its tensor
cache (`-c`, in the worker's own cache folder). The model is generated in the shape of a real one: few, wide
blocks (n_embd 2560, grouped-query attention with 4 KV heads, n_ff 6912, f16) whose attention and
feed-forward matrices are 2.5 to 34 MiB: above the 256 KiB HASH_THRESHOLD of RAMDeck's builds (upstream's
10 MiB left the 2.5 MiB K and V projections out, 3.8% of the weights; builds/rpc_threshold.py), so only the
norms stay under it. The console deploys it twice, each time a fresh deployment of the same plan on a cold
then a warm cache, and the worker's veth counts what it received (`rx_bytes` in its namespace) from the start
of each deploy until its measure step starts (the load is over then; the measure step's own samples send
activations back and forth, counted apart as `*_deploy_bytes`). A third deploy loads from the worker's own
copy of the model (see below). A load's time runs from llama-server's start to its health answer (the deploy
step's own `load_s`: the model read and the worker's weights sent; the step's whole time is kept beside as
`*_step_s`). `local_disk_s` is the same model loaded by one llama-server from its local disk, all on its CPU,
timed the same way.

The figures for benchmarks/first_word.py come out on a line `FIRST-WORD {...}`; the link is limited with a
token bucket to RAMDECK_FIRST_WORD_LINK_MBIT (default 100; 0: no limit) and the model has about
RAMDECK_FIRST_WORD_MODEL_MIB MiB (default 270: two blocks, the suite's run; benchmarks/first_word.py passes
its `--model-mib`, 512 unless told).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from django.utils import timezone

from deployments.models import Deployment, DeploymentState
from deployments.steps import checks
from jobs.models import JobState
from llamacpp import tensor_cache
from llamacpp.gguf import profile_path
from llamacpp.logs import parse_load_log
from llamacpp.rpc_wire import LinkError, measure_link
from llamacpp.source import file_sha256
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles import local_copy
from modelfiles.models import ModelCopy, ModelFile
from nodes.models import Device, DeviceKind
from nodes.pool import planner_nodes
from planning import planner
from tests.deploy_fixtures import (
    LLAMA_PORT,
    MIB,
    Cluster,
    log_text,
    start_in,
    stop_proc,
)
from tests.deploy_fixtures import run as run_job
from tests.llamacpp_build import require_llamacpp, use_cached_llamacpp

pytestmark = [
    pytest.mark.lab,
    pytest.mark.llamacpp,
    pytest.mark.e2e,
    pytest.mark.timeout(1800),
    pytest.mark.django_db(transaction=True),
]

# One block of the generated model: q and o 12.5 MiB, k and v 2.5 MiB, three 33.75 MiB feed-forward
# matrices, two norms: about 131 MiB, of which only the norms (20 KiB) are under the threshold and cross the
# link at every load.
SHAPE = {"n_embd": 2560, "n_head": 20, "n_head_kv": 4, "n_ff": 6912}
BLOCK_MIB = 131


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, "") or default)


def rx_bytes(host) -> int:
    """What the worker's end of its veth has received, read in its namespace."""
    path = f"/sys/class/net/{host.veth_ns}/statistics/rx_bytes"
    out = subprocess.run(
        host.exec_argv(["cat", path]), capture_output=True, text=True, timeout=30, check=True
    )
    return int(out.stdout.strip())


def rpc_counter(host, port: int) -> None:
    """A counting rule (no target: it only counts) for TCP to `port` in the worker's mangle table, which
    packets pass before any filter rule, the console's own firewall rule included."""
    rule = ["-p", "tcp", "--dport", str(port)]
    subprocess.run(host.exec_argv(["iptables", "-w", "-t", "mangle", "-I", "PREROUTING", *rule]), check=True)


def rpc_bytes(host, port: int) -> int:
    """Bytes (IP packets) counted so far by rpc_counter."""
    listing = ["iptables", "-w", "-t", "mangle", "-nvx", "-L", "PREROUTING"]
    out = subprocess.run(host.exec_argv(listing), capture_output=True, text=True, timeout=30, check=True)
    for line in out.stdout.splitlines():
        if f"dpt:{port}" in line:
            return int(line.split()[1])
    raise AssertionError(f"no counting rule for port {port}:\n{out.stdout}")


def _step_s(deployment: Deployment, name: str) -> float:
    job = deployment.steps.filter(name=name).select_related("job").latest("order").job
    return (job.finished_at - job.started_at).total_seconds()


def _load_s(deployment: Deployment) -> float:
    """The load as the deploy step times it (issue 20's): from llama-server's start to its health answer."""
    return next(i["load_s"] for i in deployment.processes.values() if i["role"] == "llama-server")


def _worker_model_bytes(deployment: Deployment) -> int:
    """The worker's weights as llama-server reports them (its RPC buffer's `model buffer size`)."""
    log = next(i["log"] for i in deployment.processes.values() if i["role"] == "llama-server")
    sizes = parse_load_log(Path(log).read_text(errors="replace").splitlines())["devices"]
    return sum(s["model"] for key, s in sizes.items() if key != "CPU")


def _cache_files(folder: Path) -> dict[str, int]:
    return (
        {p.name: p.stat().st_size for p in folder.glob("*") if len(p.name) == 16} if folder.exists() else {}
    )


def _local_disk_s(host, model: Path, tmp_path: Path) -> float:
    """One llama-server loading the whole model from its own disk onto its CPU: start to /health 200."""
    binaries = require_llamacpp()
    port = LLAMA_PORT + 7
    argv = [str(binaries.llama_server), "-m", str(model), "-c", "512", "--host", host.address, "--port"]
    start = time.monotonic()
    proc = start_in(host, [*argv, str(port), "--device", "none", "-ngl", "0"], tmp_path / "local.log")
    try:
        with httpx.Client(timeout=5) as client:
            while time.monotonic() - start < 600:
                assert proc.poll() is None, (tmp_path / "local.log").read_text()[-2000:]
                try:
                    if client.get(f"http://{host.address}:{port}/health").status_code == 200:
                        return time.monotonic() - start
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
    finally:
        stop_proc(proc)
    raise AssertionError("llama-server did not answer /health within 600 s")


@pytest.fixture
def pair(lab, lab_hosts, tmp_path, settings):
    use_cached_llamacpp(settings)
    cluster = Cluster(lab, lab_hosts(2), tmp_path)
    # Names of this run's own: the processes' logs go to ~/.ramdeck/run/d<deployment>-<node>-..., and the lab
    # hosts share this machine's home with every other test run on it, whose databases number their
    # deployments from 1 too and whose clusters are also called desk and old-pc-1.
    for node in cluster.nodes:
        node.name = f"{node.name}-{os.getpid()}"
        node.save(update_fields=["name"])
    cluster.build_all()
    return cluster


def test_a_warm_deploy_sends_the_worker_only_what_its_rpc_cache_cannot_hold(pair, monkeypatch, settings):
    cluster = pair
    link_mbit = _env_float("RAMDECK_FIRST_WORD_LINK_MBIT", 100)
    model_mib = _env_float("RAMDECK_FIRST_WORD_MODEL_MIB", 270)
    n_layer = max(2, round(model_mib / BLOCK_MIB))
    path = write_tiny_llama(cluster.tmp_path / "wide.gguf", TinyLlama(n_layer=n_layer, **SHAPE))
    profile = profile_path(path)
    model = ModelFile.objects.create(
        name="wide",
        node=cluster.coordinator,
        path=str(path),
        size_bytes=profile["size_bytes"],
        profile=profile,
    )
    # The worker is given room for about half the blocks, and the faster memory, so it gets them.
    worker_mib = BLOCK_MIB * (n_layer // 2) + 300
    for node, mib, gbs in ((cluster.coordinator, 24000, 2.0), (cluster.workers[0], worker_mib, 40.0)):
        Device.objects.create(
            node=node,
            name="CPU",
            kind=DeviceKind.CPU,
            total_bytes=mib * MIB,
            free_bytes=mib * MIB,
            bandwidth_gbs=gbs,
        )
    worker_host = cluster.hosts[1]
    if link_mbit:
        cluster.lab.limit_link(worker_host, link_mbit)
    # The worker's link as calibration measures it (its round trip and a 16 MiB transfer into an rpc-server),
    # so the plan's load predictions price this link, as they would a calibrated household's.
    link = _calibrate_link(cluster, worker_host)
    # The console's own view of the nodes (nodes/pool.py), the calibrated link with it.
    plan = planner.plan(
        profile, planner_nodes(cluster.workers, cluster.coordinator), planner.Settings(ctx=512)
    )
    assert plan["fits"] and any(p["endpoint"] and p["layers"] for p in plan["placements"]), plan
    cache = Path(cluster.workers[0].llama_cache_dir) / "rpc"
    assert not _cache_files(cache)
    rpc_port = cluster.workers[0].rpc_port
    rpc_counter(worker_host, rpc_port)
    figures: dict = {"link_mbit": link_mbit or None, "model_bytes": profile["size_bytes"]}
    figures["link_measured"] = {"rtt_ms": link.rtt_ms, "mbs": link.throughput_mbs}
    figures["load_predicted"] = plan["first_word"]["load"]
    figures["n_layer"] = n_layer
    names: dict[str, list[str]] = {}
    for run in ("cold", "warm", "local_copy", "refill"):
        if run == "local_copy":
            # The worker's cache is emptied, then it gets its own copy of the model (the console's copy job,
            # over SFTP), whose last step fills the cache with the whole model from the copy: the first load
            # must send almost nothing, and fill nothing more.
            for entry in cache.glob("*"):
                entry.unlink()
            figures["copy_s"], figures["copy_fill_s"] = _copy_to_worker(cluster, model, settings)
            names["copied"] = sorted(_cache_files(cache))
            figures["cache_after_copy"] = sum(_cache_files(cache).values())
        if run == "refill":
            # The cache emptied again (cleared, trimmed, or a model too large to fill whole at the copy): the
            # deploy's own rpc-server step fills the tensors of the worker's blocks from its copy.
            for entry in cache.glob("*"):
                entry.unlink()
        deployment = Deployment.objects.create(
            name=f"wide-{run}",
            model_file=model,
            coordinator=cluster.coordinator,
            plan=plan,
            plan_settings=plan["settings"],
            port=LLAMA_PORT,
            created_by=cluster.operator,
            # Direct mode: the RPC traffic has a port of its own on the worker, counted apart from SSH.
            rpc_mode="direct",
        )
        before, rpc_before = rx_bytes(worker_host), rpc_bytes(worker_host, rpc_port)
        at_measure = _count_until_measure(monkeypatch, worker_host)
        deployment = cluster.deploy(deployment, monkeypatch)
        # The load's bytes: up to the measure step, whose samples (3 × 128 tokens and two long prompts) send
        # activations to the worker and back; the whole deploy's are kept beside them.
        figures[f"{run}_deploy_bytes"] = rx_bytes(worker_host) - before
        received = at_measure["rx"] - before
        figures[f"{run}_rpc_bytes"] = rpc_bytes(worker_host, rpc_port) - rpc_before
        assert deployment.state == DeploymentState.RUNNING, (deployment.failed_step, deployment.state_reason)
        figures[f"{run}_bytes"] = received
        figures[f"{run}_s"] = round(_load_s(deployment), 3)
        figures[f"{run}_step_s"] = round(_step_s(deployment, "llama-server"), 3)
        figures[f"{run}_rpc_server_s"] = round(_step_s(deployment, "rpc-server"), 3)
        figures["weights_bytes"] = _worker_model_bytes(deployment)
        figures[f"cache_after_{run}"] = sum(_cache_files(cache).values())
        names[run] = sorted(_cache_files(cache))
        # The measure step read the worker's load over its samples too, its rpc-server's CPU time apart.
        worker_use = (deployment.verification or {})["speed"]["workers_cpu_use"][cluster.workers[0].name]
        assert worker_use["own_cpus"] > 0 and worker_use["cpus"] >= 1, worker_use
        # The measure step's first token and load against the plan's (issue 20), for the record.
        figures[f"{run}_first_word"] = (deployment.verification or {}).get("first_word")
        # The rpc_server step read (and trimmed to the limit, here far above it) the cache before the server
        # started, and counted what its fill wrote: empty before the cold run, the cold run's entries before
        # the warm one, the whole model's after the copy, and empty before the last run, then its fill.
        worker = cluster.workers[0]
        worker.refresh_from_db()
        expected = {"cold": 0, "local_copy": figures.get("cache_after_copy")}.get(
            run, figures["cache_after_cold"]
        )
        assert worker.rpc_cache_state["bytes"] == expected, worker.rpc_cache_state
        if run in ("local_copy", "refill"):
            figures[f"{run}_fill_log"] = _fill_lines(deployment)
            # The fill is part of this load: its time (the fill step's own log line) is counted in.
            filled = [line for line in figures[f"{run}_fill_log"] if "RPC cache filled in" in line]
            assert filled, figures[f"{run}_fill_log"]
            figures[f"{run}_filling_s"] = float(filled[0].split("RPC cache filled in ")[1].split(" s")[0])
            figures[f"{run}_s"] = round(figures[f"{run}_s"] + figures[f"{run}_filling_s"], 3)
            # After the copy every tensor of the worker's blocks was there; else the fill wrote each file the
            # cold load made, under the same name (so the same FNV-1a hash rpc-server computes).
            written = 0 if run == "local_copy" else len(names["cold"])
            assert f" {written} tensors written" in filled[0], (filled[0], len(names["cold"]))
        assert worker.rpc_cache_state["dir"] == str(cache)
        deployment = cluster.stop(deployment, monkeypatch)
        assert deployment.state == DeploymentState.STOPPED
        cluster.assert_clean(deployment)
    if link_mbit:
        cluster.lab.unlimit_link(worker_host)
    figures["local_disk_s"] = round(_local_disk_s(cluster.hosts[0], path, cluster.tmp_path), 3)
    weights, cached = figures["weights_bytes"], figures["cache_after_cold"]
    figures["cacheable_fraction"] = round(cached / weights, 4)
    figures["warm_fraction"] = round(figures["warm_bytes"] / weights, 4)
    figures["local_copy_fraction"] = round(figures["local_copy_bytes"] / weights, 4)
    figures["refill_fraction"] = round(figures["refill_bytes"] / weights, 4)
    figures["uncacheable_bytes"] = weights - cached
    print("\nFIRST-WORD " + json.dumps(figures))
    # Cold: every weight crossed the link, and the cache kept each tensor above the threshold: all but the
    # norms.
    assert figures["cold_bytes"] >= weights
    assert 0.999 * weights < cached <= weights
    # Warm: the cache is not written again, and what crosses until the measure step is the norms, plus the
    # load's own traffic (SSH, a hash for each cached tensor): under 5% of the weights (issue 20's target).
    assert figures["cache_after_warm"] == cached
    assert figures["warm_bytes"] < 0.05 * weights, figures
    # Local copy: the copy job filled the whole model (the cold load's files among them, under the same
    # names), and the load sent almost nothing and wrote nothing.
    assert set(names["cold"]) < set(names["copied"]) and names["local_copy"] == names["copied"]
    assert figures["local_copy_bytes"] < 0.05 * weights, figures
    # Filled at the deploy from an empty cache: exactly the cold load's files, and almost nothing sent.
    assert names["refill"] == names["cold"]
    assert figures["refill_bytes"] < 0.05 * weights, figures


def _calibrate_link(cluster, host):
    """The worker's link measured as the calibrate job measures it (llamacpp/rpc_wire.py measure_link against
    an rpc-server on the worker), recorded on the node as calibration records it."""
    binaries = require_llamacpp()
    port = LLAMA_PORT + 9
    argv = [str(binaries.rpc_server), "-H", host.address, "-p", str(port)]
    proc = start_in(host, argv, cluster.tmp_path / "link-rpc.log")
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                link = asyncio.run(measure_link(host.address, port))
                break
            except LinkError:
                assert proc.poll() is None, (cluster.tmp_path / "link-rpc.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "the link's rpc-server did not answer within 30 s"
                time.sleep(0.2)
    finally:
        stop_proc(proc)
    worker = cluster.workers[0]
    worker.link_rtt_ms, worker.link_throughput_mbs = link.rtt_ms, link.throughput_mbs
    worker.calibrated_at = timezone.now()
    worker.save(update_fields=["link_rtt_ms", "link_throughput_mbs", "calibrated_at"])
    return link


def _count_until_measure(monkeypatch, host) -> dict:
    """The worker's received bytes when the measure step starts (the load is over: llama-server answered
    its health check and the placement was verified)."""
    original = checks.measure_body
    seen: dict = {}

    async def counted(ctx):
        seen["rx"] = rx_bytes(host)
        return await original(ctx)

    monkeypatch.setattr(checks, "measure_body", counted)
    return seen


def _fill_lines(deployment: Deployment) -> list[str]:
    job = deployment.steps.filter(name="rpc-server").select_related("job").latest("order").job
    return [line for line in log_text(job).splitlines() if "RPC cache fill" in line or "Filling" in line]


def _copy_to_worker(cluster, model: ModelFile, settings) -> tuple[float, float]:
    """The model copied to the worker by the console's `model_copy` job (from the coordinator over SFTP,
    through the console), registered for the worker, its tensors hashed, its cache filled from the copy: the
    job's time, and its fill's."""
    settings.RAMDECK_NODE_MODEL_DIR = str(cluster.tmp_path / "worker-models")
    worker = cluster.workers[0]
    job = local_copy.start_copy(model, worker, local_copy.default_destination(model), cluster.operator)
    job = run_job(job)
    assert job.state == JobState.SUCCEEDED, log_text(job)
    copy = ModelCopy.objects.get(model=model, node=worker)
    assert copy.sha256 == file_sha256(Path(model.path)) and copy.path != model.path
    model.refresh_from_db()
    assert tensor_cache.valid(model.tensor_hashes)
    filled = [line for line in log_text(job).splitlines() if "RPC cache filled in" in line]
    assert filled, log_text(job)
    fill_s = float(filled[0].split("RPC cache filled in ")[1].split(" s")[0])
    return round((job.finished_at - job.started_at).total_seconds(), 3), fill_s
