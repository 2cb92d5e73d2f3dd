"""Proof against real llama.cpp: run the planned arguments and compare what llama.cpp logs with the plan.

For generated models (GQA; tied embeddings; two shards) the test plans a cluster of real ggml-rpc-servers on
127.0.0.1, starts the servers with the planned arguments, runs llama-server with exactly the planned
arguments and `-lv 4` until /health answers 200, and checks every device's logged model, KV and compute
buffers against the plan. rpc-servers report all of RAM as free, so the cluster handed to the planner gets
small synthetic capacities that force a split over several devices.

With pipeline parallelism on, a CPU worker is held to what it really holds rather than to what llama.cpp
reserves (the kernel charges an rpc-server only for the pages it writes; planning/costs.py): the
test sends prompts that fill the context and compares each rpc-server's peak resident memory (VmHWM) with
the plan.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from llamacpp import gguf as gguf_profile
from llamacpp.logs import parse_load_log, parse_rpc_banner, placement_key
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from planning import planner
from ramdeck_site.services import free_port
from tests.llamacpp_build import require_llamacpp

pytestmark = pytest.mark.llamacpp
MIB = 1024 * 1024
START_TIMEOUT = 180.0


def stop(proc: subprocess.Popen) -> None:
    """End a process we started, by its PID: TERM, then KILL."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


class Processes:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], name: str) -> tuple[subprocess.Popen, Path]:
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc, log

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            stop(proc)


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path)
    yield procs
    procs.stop_all()


@pytest.fixture(scope="module")
def binaries():
    return require_llamacpp()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "gqa": write_tiny_llama(root / "gqa.gguf", TinyLlama(n_head_kv=2)),
        "tied": write_tiny_llama(root / "tied.gguf", TinyLlama(n_head_kv=4, tied_embeddings=True)),
        "split": write_tiny_llama(root / "split.gguf", TinyLlama(n_layer=24, n_head_kv=2, shards=2)),
        "moe": write_tiny_llama(root / "moe.gguf", TinyLlama(n_layer=4, n_expert=8, n_expert_used=2)),
    }


def make_cluster(
    cpu: tuple[float, float], workers: list[tuple[float, float]]
) -> tuple[list[planner.Node], list]:
    """(capacity MiB, bandwidth GB/s) for the coordinator's CPU and each worker; workers get free ports.

    No hop cost: these clusters are about where memory goes, and every worker should be worth its hop."""

    def device(node: str, mib: float, bw: float) -> planner.Device:
        return planner.Device(node, "CPU", "cpu", int(mib * MIB), int(mib * MIB), bw)

    nodes = [planner.Node("desk", "127.0.0.1", (device("desk", *cpu),), coordinator=True)]
    for i, (mib, bw) in enumerate(workers):
        name = f"w{i + 1}"
        nodes.append(
            planner.Node(
                name, "127.0.0.1", (device(name, mib, bw),), rpc_port=free_port(), rtt_ms=0.05, hop_ms=0.0
            )
        )
    return nodes, workers


def resident(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (VmRSS) or its peak (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


def start_rpc_servers(binaries, processes: Processes, plan: dict) -> list[dict]:
    """Start every planned rpc-server; its banner, with "pid" and "idle_rss" (resident memory, no client)."""
    banners = []
    for server in plan["rpc_servers"]:
        proc, log = processes.start(
            ["stdbuf", "-oL", str(binaries.rpc_server), *server["args"]], server["node"]
        )
        deadline = time.monotonic() + 30
        while True:
            banner = parse_rpc_banner(log.read_text(errors="replace"))
            if banner["endpoint"] and banner["devices"]:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", server["port"]), 1):
                    break
            assert proc.poll() is None, f"rpc-server exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"rpc-server did not start: {log.read_text()}"
            time.sleep(0.1)
        assert banner["endpoint"] == f"127.0.0.1:{server['port']}"
        assert [d["name"] for d in banner["devices"]] == server["devices"]
        banner.update(pid=proc.pid, idle_rss=resident(proc.pid), endpoint=f"127.0.0.1:{server['port']}")
        banners.append(banner)
    return banners


def fill_the_context(url: str, ctx: int) -> None:
    """Prompts as long as the context (a whole ubatch: the most of a compute buffer a device ever writes),
    several times, so that each of the scheduler's input copies takes its turn."""
    text = "".join(chr(97 + (i * 7) % 26) for i in range(4 * ctx))
    tokens = httpx.post(f"{url}/tokenize", json={"content": text}, timeout=60).json()["tokens"]
    body = {"prompt": tokens[: ctx - 12], "n_predict": 8, "cache_prompt": False, "ignore_eos": True}
    for _ in range(5):
        answer = httpx.post(f"{url}/completion", json=body, timeout=300)
        assert answer.status_code == 200 and answer.json()["timings"]["prompt_n"] >= ctx - 12


def run_llama_server(
    binaries, processes: Processes, model: Path, plan: dict, *, fill_context: bool = False
) -> dict:
    port = free_port()
    argv = [str(binaries.llama_server), "-m", str(model), *plan["llama_server_args"]]
    argv += ["--host", "127.0.0.1", "--port", str(port), "-lv", "4"]
    proc, log = processes.start(argv, "llama-server")
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        assert proc.poll() is None, f"llama-server exited {proc.returncode}:\n{log.read_text()[-4000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "llama-server did not become healthy"
        time.sleep(0.25)
    if fill_context:
        args = plan["llama_server_args"]
        fill_the_context(f"http://127.0.0.1:{port}", int(args[args.index("-c") + 1]))
    stop(proc)
    return parse_load_log(log.read_text(errors="replace").splitlines())


def close(logged: int, planned: int) -> bool:
    return abs(logged - planned) <= max(0.02 * planned, 0.1 * MIB)


def lazy(plan: dict, placement: dict) -> bool:
    """A CPU worker under pipeline parallelism: held to what it writes, not to llama.cpp's reservation."""
    return plan["pipeline_parallel"] and bool(placement["endpoint"]) and placement["device"] == "CPU"


def check_against_log(plan: dict, logged: dict, profile: dict) -> None:
    devices = logged["devices"]
    report = json.dumps({"plan": plan["placements"], "log": logged}, indent=1)
    ngl = int(plan["llama_server_args"][plan["llama_server_args"].index("-ngl") + 1])
    assert logged["offloaded"] == [ngl, plan["n_layer"] + 1], report
    assert set(devices) == {placement_key(p) for p in plan["placements"]}, report
    block = profile["block_weight_bytes"][0]
    for p in plan["placements"]:
        got = devices[placement_key(p)]
        assert close(got["model"], p["weights_bytes"]), (p["llama_device"], got, report)
        assert close(got["kv"], p["kv_bytes"]), (p["llama_device"], got, report)
        # The block count llama.cpp gave this device, from its model buffer.
        fixed = p["weights_bytes"] - p["layers"] * block
        assert round((got["model"] - fixed) / block) == p["layers"], report
        # The compute estimate is an upper bound (to 2%: without pipeline parallelism it is llama.cpp's own
        # figure, tests/planning/test_memory_vs_llamacpp.py), within 2x (the CPU's logits buffer counts as
        # compute): a coordinator CPU that holds a single block of these small models needs no room for
        # the attention mask beside its feed-forward, which the plan counts. For a CPU worker under pipeline
        # parallelism, of what it writes (`check_held`), and within 2x of what llama.cpp reserves.
        actual = got["compute"] + got["output"]
        assert lazy(plan, p) or actual <= p["compute_bytes"] * 1.02, (p["llama_device"], actual, report)
        assert p["compute_bytes"] <= 2 * actual, (
            p["llama_device"],
            actual,
            p["compute_bytes"],
            report,
        )


def check_held(plan: dict, logged: dict, banners: list[dict]) -> None:
    """Each CPU worker's peak resident memory after full prompts, less its idle size, its weights and its KV
    cache: what its compute buffer really held, within the plan's estimate."""
    by_endpoint = {b["endpoint"]: b for b in banners}
    for p in plan["placements"]:
        if not lazy(plan, p):
            continue
        banner = by_endpoint[p["endpoint"]]
        got = logged["devices"][placement_key(p)]
        held = (
            resident(banner["pid"], "VmHWM") - banner["idle_rss"] - got["model"] - got["output"] - got["kv"]
        )
        print(
            f"{p['endpoint']}: held {held / MIB:.2f} MiB of compute, llama.cpp reserved "
            f"{got['compute'] / MIB:.2f}, the plan counts {p['compute_bytes'] / MIB:.2f}"
        )
        assert 0 < held <= p["compute_bytes"], (p["endpoint"], held, p["compute_bytes"])


def plan_and_prove(
    binaries, processes, model: Path, nodes, settings: planner.Settings, *, min_devices: int
) -> dict:
    profile = gguf_profile.profile_path(model)
    plan = planner.plan(profile, nodes, settings)
    assert plan["fits"], plan
    busy = [p for p in plan["placements"] if p["layers"] > 0]
    assert len(busy) >= min_devices, plan["placements"]  # a non-trivial split
    assert len(plan["rpc_servers"]) >= 2
    banners = start_rpc_servers(binaries, processes, plan)
    fill = plan["pipeline_parallel"]
    logged = run_llama_server(binaries, processes, model, plan, fill_context=fill)
    check_against_log(plan, logged, profile)
    if fill:
        check_held(plan, logged, banners)
    return plan


def test_gqa_model_lands_where_the_planner_put_it(binaries, processes, models):
    # Coordinator CPU slow; three workers of falling speed and room for only a few blocks each.
    nodes, _ = make_cluster((24, 5), [(11, 100), (10, 50), (9, 20)])
    plan = plan_and_prove(
        binaries,
        processes,
        models["gqa"],
        nodes,
        planner.Settings(ctx=1024, margin_fraction=0),
        min_devices=3,
    )
    assert plan["placements"][0]["llama_device"] == "CPU" and plan["placements"][0]["layers"] >= 1
    assert plan["pipeline_parallel"] is False


def test_tied_embedding_model_with_quantised_kv_and_two_slots(binaries, processes, models):
    nodes, _ = make_cluster((30, 5), [(12, 100), (12, 60)])
    settings = planner.Settings(ctx=2048, parallel=2, cache_type="q8_0", margin_fraction=0)
    plan = plan_and_prove(binaries, processes, models["tied"], nodes, settings, min_devices=2)
    last = plan["placements"][-1]
    assert last["output_layer"] and last["endpoint"]  # the token_embd copy went to a worker


def test_two_shard_model_with_every_layer_offloaded_uses_pipeline_parallel_buffers(
    binaries, processes, models
):
    # No worker can hold the whole model, and the coordinator's CPU is very slow: every layer goes to the
    # workers, which turns on pipeline parallelism (four copies of every split's inputs; CPU workers are held
    # to what they write, `check_held`).
    nodes, _ = make_cluster((20, 1), [(34, 100), (34, 80), (34, 50)])
    settings = planner.Settings(ctx=512, margin_fraction=0)
    plan = plan_and_prove(binaries, processes, models["split"], nodes, settings, min_devices=2)
    assert plan["pipeline_parallel"] is True
    assert plan["placements"][0]["layers"] == 0


def test_experts_placed_on_another_worker_than_their_attention_land_there(binaries, processes, models):
    """A Mixtral-style model on a fast worker with little memory and a slower one with much: the fast one
    runs the last block's attention and the output layer, the other holds that block's experts (an `-ot`
    rule with its RPC buffer's name), and llama.cpp allocates on each worker what the plan put there.
    No RPC cost per hop here (loopback), so placing experts apart is priced by their bytes alone."""

    def node(name: str, mib: float, bw: float, **fields) -> planner.Node:
        device = planner.Device(name, "CPU", "cpu", int(mib * MIB), int(mib * MIB), bw)
        return planner.Node(name, "127.0.0.1", (device,), **fields)

    nodes = [
        node("desk", 20, 1, coordinator=True),
        node("w1", 8, 100, rpc_port=free_port(), rtt_ms=0.0, hop_ms=0.0),
        node("w2", 64, 50, rpc_port=free_port(), rtt_ms=0.0, hop_ms=0.0),
    ]
    profile = gguf_profile.profile_path(models["moe"])
    plan = planner.plan(profile, nodes, planner.Settings(ctx=512, margin_fraction=0))
    assert plan["fits"] and plan["places_experts"], plan
    by_node = {p["node"]: p for p in plan["placements"]}
    fast, big = by_node["w1"], by_node["w2"]
    assert fast["output_layer"] and fast["layers"] >= 1 and fast["expert_blocks"] == []
    own = range(fast["first_layer"], fast["first_layer"] + fast["layers"])
    assert set(own) <= set(big["expert_blocks"])  # the fast worker's blocks' experts are on the big one
    assert any(a == "-ot" for a in plan["llama_server_args"])
    start_rpc_servers(binaries, processes, plan)
    logged = run_llama_server(binaries, processes, models["moe"], plan)
    report = json.dumps({"plan": plan["placements"], "log": logged}, indent=1)
    ngl = int(plan["llama_server_args"][plan["llama_server_args"].index("-ngl") + 1])
    assert logged["offloaded"] == [ngl, plan["n_layer"] + 1], report
    for p in plan["placements"]:
        if p["llama_device"] == "CPU":
            continue
        got = logged["devices"][placement_key(p)]
        assert close(got["model"], p["weights_bytes"]), (p["node"], got, report)
        assert close(got["kv"], p["kv_bytes"]), (p["node"], got, report)
    # The fast worker holds no expert: its bytes are its blocks' dense part and the output layer.
    experts = profile["block_expert_bytes"][0]
    assert logged["devices"][placement_key(fast)]["model"] < experts, report
