"""The plan's memory against llama.cpp's own log for the real model (SmolLM2-135M-Instruct, tied embeddings,
blocks stored out of numeric order): weights and compute buffer within 2% on every device, the coordinator's
CPU included, on one machine at a few contexts and batch sizes and split over the CPU and an RPC worker on
localhost. Real llama-server and ggml-rpc-server with exactly the planned arguments and `-lv 4`."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from llamacpp.gguf import profile_path
from llamacpp.logs import parse_load_log, placement_key
from planning import planner
from planning.placement import compare
from ramdeck_site.services import free_port
from tests.llamacpp_build import require_llamacpp
from tests.real_model import require_real_model

pytestmark = [pytest.mark.llamacpp, pytest.mark.timeout(600)]
MIB = 2**20


def within(logged: int, planned: int) -> bool:
    """2%, or 0.1 MiB for a buffer of a few MiB (planning/placement.py holds llama.cpp to the same)."""
    return abs(logged - planned) <= max(0.02 * logged, 0.1 * MIB)


@pytest.fixture(scope="module")
def gguf() -> Path:
    return require_real_model()


class Started:
    def __init__(self, tmp: Path) -> None:
        self.tmp, self.procs = tmp, []

    def start(self, argv: list[str], name: str) -> tuple[subprocess.Popen, Path]:
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc, log

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=15)


@pytest.fixture
def started(tmp_path):
    procs = Started(tmp_path)
    yield procs
    procs.stop_all()


def logged_for(binaries, started: Started, gguf: Path, plan: dict) -> str:
    """llama-server's log for the plan (its rpc-servers started first), once /health answers."""
    for server in plan["rpc_servers"]:
        proc, log = started.start([str(binaries.rpc_server), *server["args"]], server["node"])
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", server["port"]), 1):
                break
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
    port = free_port()
    argv = [str(binaries.llama_server), "-m", str(gguf), *plan["llama_server_args"]]
    proc, log = started.start([*argv, "--host", "127.0.0.1", "--port", str(port), "-lv", "4"], "llama-server")
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                break
        assert time.monotonic() < deadline, "llama-server did not become healthy"
        time.sleep(0.25)
    started.stop_all()
    return log.read_text(errors="replace")


def check(plan: dict, log: str) -> list[str]:
    """Every device's weights and compute (with the CPU's logits buffer) against the log; the lines."""
    devices = parse_load_log(log.splitlines())["devices"]
    assert set(devices) == {placement_key(p) for p in plan["placements"]}, (devices, plan["placements"])
    lines = []
    for p in plan["placements"]:
        got = devices[placement_key(p)]
        compute = got["compute"] + got["output"]
        lines.append(
            f"{placement_key(p)}: weights {got['model'] / MIB:.2f} MiB logged, "
            f"{p['weights_bytes'] / MIB:.2f} planned; compute {compute / MIB:.2f} logged, "
            f"{p['compute_bytes'] / MIB:.2f} planned"
        )
        assert within(got["model"], p["weights_bytes"]), lines
        assert within(got["kv"], p["kv_bytes"]), lines
        assert within(compute, p["compute_bytes"]), lines
    # The console's own check (the verify step) agrees, the coordinator's CPU included.
    report = compare(plan, log)
    assert report["problems"] == [] and all(r["checked"] and r["ok"] for r in report["devices"].values())
    return lines


def one_cpu() -> list[planner.Node]:
    cpu = planner.Device("desk", "CPU", "cpu", 8000 * MIB, 8000 * MIB, 5.0)
    return [planner.Node("desk", "127.0.0.1", (cpu,), coordinator=True)]


@pytest.mark.parametrize(
    ("ctx", "ubatch", "parallel"),
    [(512, 512, 1), (2048, 512, 1), (4096, 512, 2), (4096, 256, 1), (8192, 128, 1)],
)
def test_the_real_model_on_one_cpu_is_planned_as_llama_cpp_allocates_it(started, gguf, ctx, ubatch, parallel):
    binaries = require_llamacpp()
    profile = profile_path(gguf)
    settings = planner.Settings(ctx=ctx, ubatch=ubatch, parallel=parallel)
    plan = planner.plan(profile, one_cpu(), settings)
    assert plan["fits"] and plan["placements"][0]["layers"] == 30
    # The tied output matrix is token_embd itself: one copy of it, not two.
    assert plan["placements"][0]["weights_bytes"] < profile["weights_total_bytes"] * 1.01
    print("\n" + "\n".join(check(plan, logged_for(binaries, started, gguf, plan))))


@pytest.mark.parametrize("ctx", [512, 4096])
def test_the_real_model_split_over_the_cpu_and_an_rpc_worker_is_planned_as_llama_cpp_allocates_it(
    started, gguf, ctx
):
    binaries = require_llamacpp()
    profile = profile_path(gguf)
    # A slow coordinator and a fast worker with room for part of the model: blocks on both, the output
    # (a copy of the tied token_embd) on the worker.
    cpu = planner.Device("desk", "CPU", "cpu", 8000 * MIB, 8000 * MIB, 2.0)
    worker = planner.Device("w1", "CPU", "cpu", 72 * MIB, 72 * MIB, 40.0)
    nodes = [
        planner.Node("desk", "127.0.0.1", (cpu,), coordinator=True),
        planner.Node("w1", "127.0.0.1", (worker,), rpc_port=free_port(), rtt_ms=0.05, hop_ms=0.0),
    ]
    plan = planner.plan(profile, nodes, planner.Settings(ctx=ctx))
    assert plan["fits"], plan
    layers = {p["node"]: p["layers"] for p in plan["placements"]}
    assert layers["desk"] > 0 and layers["w1"] > 0 and plan["placements"][-1]["output_layer"]
    assert plan["pipeline_parallel"] is False
    lines = check(plan, logged_for(binaries, started, gguf, plan))
    print("\n" + json.dumps(layers) + "\n" + "\n".join(lines))
