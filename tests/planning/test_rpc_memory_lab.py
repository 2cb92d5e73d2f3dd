"""What a CPU ggml-rpc-server really holds, under a memory limit, against what the planner counts for it.

A lab host held by the cgroup `memory` controller to the model's weights and 8 MiB (the needs_both case of
benchmarks/split_speed.py) runs a real ggml-rpc-server; a second, unlimited host runs another. The planner
plans the split_speed model over them with pipeline parallelism (every block on the workers); llama-server
runs exactly the plan and gets prompts that fill the context (a whole ubatch: the most of its compute buffer
a device ever writes), several times so that every one of the scheduler's input copies takes a turn. The
limited worker must survive, and what it holds beyond its weights and KV cache must be within the plan's
compute estimate. One block more on that worker: the planner refuses it, and llama.cpp, run that way anyway,
gets the worker OOM-killed. The figures are printed (the memory model's comment cites them).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest

from llamacpp import gguf as gguf_profile
from llamacpp.logs import parse_load_log
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from planning import planner
from planning.costs import Split, build_problem, evaluate
from ramdeck_site.services import free_port
from tests.deploy_fixtures import listeners_in, stop_proc
from tests.llamacpp_build import require_llamacpp

pytestmark = [pytest.mark.lab, pytest.mark.llamacpp, pytest.mark.timeout(900)]

MIB = 2**20
RPC_PORT = 50052
CTX = 512
# benchmarks/split_speed.py's model and its needs_both headroom.
WIDTH = {"n_embd": 1536, "n_head": 12, "n_head_kv": 4, "n_ff": 4096, "n_ctx_train": 2048}
HEADROOM_MIB = 8
FULL_PROMPTS = 5


class Worker:
    def __init__(self, host, log: Path):
        self.host = host
        argv = host.limited_argv(["stdbuf", "-oL", str(require_llamacpp().rpc_server), "-H", host.address,
                                  "-p", str(RPC_PORT)])  # fmt: skip
        with log.open("w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while not listeners_in(host, RPC_PORT):
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)

    @property
    def endpoint(self) -> str:
        return f"{self.host.address}:{RPC_PORT}"

    def alive(self) -> bool:
        return self.proc.poll() is None


def memory(group: Path, name: str) -> int:
    return int((group / name).read_text())


def oom_kills(group: Path) -> int:
    fields = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    return int(fields.get("oom_kill", 0))


def cpu(node: str, total: int, free: int, gbs: float) -> planner.Device:
    return planner.Device(node, "CPU", "cpu", total, free, gbs, bandwidth_source="measured")


def serve_full_prompts(model: Path, args: list[str], log: Path) -> tuple[bool, str]:
    """llama-server with `args`; FULL_PROMPTS prompts that fill the context, then a short decode. (whether
    every answer came, what happened)."""
    port = free_port()
    argv = [str(require_llamacpp().llama_server), "-m", str(model), *args, "-lv", "4"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                return False, f"llama-server exited {proc.returncode} while loading"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "llama-server did not load"
            time.sleep(0.3)
        text = "".join(chr(97 + (i * 7) % 26) for i in range(4 * CTX))
        tokens = httpx.post(f"{url}/tokenize", json={"content": text}, timeout=60).json()["tokens"]
        body = {"prompt": tokens[: CTX - 12], "n_predict": 8, "cache_prompt": False, "ignore_eos": True}
        for i in range(FULL_PROMPTS):
            try:
                answer = httpx.post(f"{url}/completion", json=body, timeout=600)
            except httpx.HTTPError as exc:
                return False, f"full prompt {i + 1}: {exc!r}"
            if answer.status_code != 200:
                return False, f"full prompt {i + 1}: HTTP {answer.status_code}"
            assert answer.json()["timings"]["prompt_n"] >= CTX - 12
        short = {"prompt": "The quick brown fox", "n_predict": 16, "cache_prompt": False, "ignore_eos": True}
        speed = httpx.post(f"{url}/completion", json=short, timeout=600).json()["timings"][
            "predicted_per_second"
        ]
        return True, f"{speed:.1f} tok/s"
    finally:
        stop_proc(proc)


def test_a_cpu_rpc_worker_holds_what_the_plan_counts_and_one_block_more_does_not_fit(lab, tmp_path):
    model = write_tiny_llama(tmp_path / "split.gguf", TinyLlama(n_layer=8, seed=42, **WIDTH))
    profile = gguf_profile.profile_path(model)
    fast_host, slow_host = lab.add_host(sshd=False), lab.add_host(sshd=False)
    limit = int(sum(profile["block_weight_bytes"]) + profile["output_bytes"]) + HEADROOM_MIB * MIB
    group = lab.limit_memory(fast_host, limit)
    fast, slow = Worker(fast_host, tmp_path / "fast.log"), Worker(slow_host, tmp_path / "slow.log")
    idle = memory(group, "memory.usage_in_bytes")
    # What the probe would report: the limit, less what the group holds without a client (the idle server).
    # Speeds as calibration finds them (fast ten times the slow one); the test is about memory.
    link = {"rtt_ms": 0.1, "hop_ms": 0.3}
    nodes = [
        planner.Node("desk", "127.0.0.1", (cpu("desk", 72 * MIB, 60 * MIB, 5.0),), coordinator=True),
        planner.Node("fast", fast_host.address, (cpu("fast", limit, limit - idle, 10.0),), **link),
        planner.Node("slow", slow_host.address, (cpu("slow", 8192 * MIB, 8192 * MIB, 1.0),), **link),
    ]
    settings = planner.Settings(ctx=CTX)
    plan = planner.plan(profile, nodes, settings)
    assert plan["fits"] and plan["pipeline_parallel"], plan
    on_fast = next(p for p in plan["placements"] if p["node"] == "fast")
    assert 0 < on_fast["layers"] < 8, plan["placements"]

    (group / "memory.max_usage_in_bytes").write_text("0")
    ok, what = serve_full_prompts(model, plan["llama_server_args"], tmp_path / "plan.log")
    logged = parse_load_log((tmp_path / "plan.log").read_text(errors="replace").splitlines())
    got = logged["devices"][fast.endpoint]
    peak = memory(group, "memory.max_usage_in_bytes")
    held = peak - idle - got["model"] - got["kv"]
    print(
        f"\nlimit {limit / MIB:.1f} MiB, idle rpc-server {idle / MIB:.1f} MiB; plan: "
        f"{on_fast['layers']} blocks{' + output' if on_fast['output_layer'] else ''} on the limited worker: "
        f"peak {peak / MIB:.1f} MiB, "
        f"compute held {held / MIB:.1f} MiB (llama.cpp reserved {got['compute'] / MIB:.2f}, the plan counts "
        f"{on_fast['compute_bytes'] / MIB:.1f}); {what}"
    )
    assert ok and fast.alive() and slow.alive(), what
    assert oom_kills(group) == 0 and peak <= limit
    assert 0 < held <= on_fast["compute_bytes"], (held, on_fast)
    assert got["model"] == pytest.approx(on_fast["weights_bytes"], rel=0.02)

    # One block more on the limited worker, one less on the other: the planner refuses it ...
    problem = build_problem(profile, nodes, settings)
    index = {slot.node.name: i for i, slot in enumerate(problem.slots)}
    busy = [p for p in plan["placements"] if p["node"] != "desk"]
    order = [index[p["node"]] for p in busy]
    counts = [p["layers"] + (1 if p["node"] == "fast" else -1) for p in busy]
    assert evaluate(problem, Split(0, order, [p["layers"] for p in busy])).fits
    assert not evaluate(problem, Split(0, order, counts)).fits
    # ... and llama.cpp, made to do it, loses the worker to the OOM killer at the first full prompt.
    args = list(plan["llama_server_args"])
    shares = [int(x) for x in args[args.index("-ts") + 1].split(",")]
    shares = [s + (1 if p["node"] == "fast" else -1) for s, p in zip(shares, busy, strict=True)]
    args[args.index("-ts") + 1] = ",".join(map(str, shares))
    (group / "memory.max_usage_in_bytes").write_text("0")
    ok, what = serve_full_prompts(model, args, tmp_path / "beyond.log")
    peak = memory(group, "memory.max_usage_in_bytes")
    split = " ".join(args[args.index("-ts") : args.index("-ts") + 2])
    print(f"one block more ({split}): {what}; peak {peak / MIB:.1f} MiB, OOM kills {oom_kills(group)}")
    assert not ok and not fast.alive() and oom_kills(group) >= 1, what
    for worker in (fast, slow):
        stop_proc(worker.proc)
