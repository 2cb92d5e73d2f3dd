"""The first-token part of benchmarks/first_word.py (issue 20): the plan's split against llama.cpp's default
for a long prompt, measured and set beside the prediction (planning/first_word.py).

On this machine, over loopback: two ggml-rpc-servers (the workers, one thread each) and llama-server (the
coordinator, whose CPU is given too little memory to hold a block, so every block goes to the workers). The
figures the planner needs are measured first the way the calibrate job measures them (calibration/job.py):
a worker's decode bandwidth from the shallow and deep calibration models, its prompt throughput from a prompt
of a few hundred tokens in one ubatch, the pass and hop costs from the tiny model, and the link's round trip
and bulk throughput with the RPC protocol (llamacpp/rpc_wire.py). Both workers are the same CPU with the same
thread count, so the first worker's figures stand for both. Then the plan (planning/planner.py) and
llama.cpp's default split (same --rpc, no -ts) are started in alternation, `--rounds` times each; each start
times the first token after a `--prompt-tokens` prompt (token ids of that exact length, n_predict 1,
cache_prompt false) twice and decodes 128 tokens. Medians are reported.

Loopback has no link to speak of: the activations' share of the first token is the link model's smallest
case here. The lab (tests/lab, a tc rate limit) would price a real link; this part does not use it.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import django
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ramdeck_site.settings")
django.setup()

from calibration.fit import CalibrationModel, Run, fit, prompt_gflops
from calibration.job import BATCH_PROMPT, MODELS, PROMPT
from llamacpp.gguf import profile_path
from llamacpp.rpc_wire import measure_link
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from planning import planner
from planning.cluster import Device, Node, Settings
from planning.first_word import block_flops, output_flops, ttft_at

GIB = 2**30
# The coordinator's memory as the plan sees it: room for the input embedding and the compute buffers of
# pipeline parallelism, not for a block of the model (so every block goes to the workers).
COORDINATOR_MIB = int(os.environ.get("RAMDECK_FIRST_WORD_COORDINATOR_MIB", "48"))
LONG_TEXT = " ".join(
    f"Note {i}: the shared machines of the household and what each holds." for i in range(400)
)


class Servers:
    def __init__(self, folder: Path):
        self.folder = folder
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], name: str) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "w")  # noqa: SIM115 (closed with the process's end)
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in list(self.procs):
            self.stop(proc)


def _port() -> int:
    return 40000 + secrets.randbelow(20000)


def _wait_port(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a server on port {port} exited at start")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise SystemExit(f"nothing listens on port {port} after {timeout:g} s")


class LlamaServer:
    """llama-server started with `args`, until `stop`; its load time from start to /health 200."""

    def __init__(self, servers: Servers, binary: str, model: str, args: list[str], name: str):
        self.servers, self.port = servers, _port()
        argv = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(self.port), "--poll", "0", *args]
        started = time.monotonic()
        self.proc = servers.start(argv, name)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(timeout=900)
        while True:
            if self.proc.poll() is not None:
                tail = (servers.folder / f"{name}.log").read_text()[-2000:]
                raise SystemExit(f"llama-server ({name}) exited while loading:\n{tail}")
            try:
                if self.client.get(f"{self.url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.load_s = time.monotonic() - started

    def completion(self, body: dict) -> dict:
        response = self.client.post(f"{self.url}/completion", json=body)
        if response.status_code != 200:
            raise SystemExit(f"/completion answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def decode_tps(self, tokens: int) -> float:
        body = {"prompt": PROMPT, "n_predict": tokens, "cache_prompt": False, "ignore_eos": True}
        return float(self.completion(body)["timings"]["predicted_per_second"])

    def first_token_s(self, n_tokens: int) -> float:
        tokens = self.client.post(f"{self.url}/tokenize", json={"content": LONG_TEXT}).json()["tokens"]
        prompt = (tokens * (n_tokens // len(tokens) + 1))[:n_tokens]
        start = time.monotonic()
        self.completion({"prompt": prompt, "n_predict": 1, "cache_prompt": False})
        return time.monotonic() - start

    def stop(self) -> None:
        self.client.close()
        self.servers.stop(self.proc)


def _calibration_model(folder: Path, name: str, spec: TinyLlama) -> tuple[str, CalibrationModel]:
    path = folder / f"{name}.gguf"
    write_tiny_llama(path, spec)
    profile = profile_path(path)
    matrices, attention = block_flops(profile)
    read = sum(profile["block_weight_bytes"]) + int(profile["output_bytes"])
    model = CalibrationModel(
        name,
        str(path),
        path.name,
        path.stat().st_size,
        read,
        sum(matrices),
        sum(attention),
        output_flops(profile),
    )
    return str(path), model


def calibrate(servers: Servers, bins, folder: Path, rpc_port: int) -> dict:
    """A worker's figures, measured as the calibrate job measures them (see the module's docstring)."""
    through = [
        "--rpc",
        f"127.0.0.1:{rpc_port}",
        "--device",
        "RPC0",
        "-ngl",
        "999",
        "-t",
        "1",
        "-c",
        "512",
        "--fit",
        "off",
    ]
    runs, models = {}, {}
    for name in ("shallow", "deep", "tiny"):
        path, model = _calibration_model(folder, f"calibrate-{name}", MODELS[name])
        models[name] = model
        placements = {"through": through}
        if name == "tiny":
            placements["alone"] = ["--device", "none", "-ngl", "0", "-t", "1", "-c", "512", "--fit", "off"]
        for label, args in placements.items():
            server = LlamaServer(servers, str(bins.llama_server), path, args, f"calibrate-{name}-{label}")
            try:
                server.decode_tps(8)
                speeds = [server.decode_tps(64) for _ in range(3)]
                run = Run(name, model.read_bytes, speeds)
                if name == "deep":
                    prompts = [
                        server.completion({"prompt": BATCH_PROMPT, "n_predict": 1, "cache_prompt": False})[
                            "timings"
                        ]
                        for _ in range(2)
                    ]
                    run.prompt_tokens = prompts[0]["prompt_n"]
                    run.prompt_per_s = [p["prompt_per_second"] for p in prompts]
                runs[(name, label)] = run
            finally:
                server.stop()
    line = fit(runs[("shallow", "through")], runs[("deep", "through")])
    gflops = prompt_gflops(models["deep"], runs[("deep", "through")])
    alone, one = runs[("tiny", "alone")], runs[("tiny", "through")]
    link = asyncio.run(measure_link("127.0.0.1", rpc_port))
    figures = {
        "bandwidth_gbs": line.bandwidth_bps / 1e9 if line.bandwidth_bps else 20.0,
        "prompt_gflops": gflops,
        "pass_ms": 1000 * alone.seconds_per_token,
        "hop_ms": max(0.0, 1000 * (one.seconds_per_token - alone.seconds_per_token)),
        "rtt_ms": link.rtt_ms,
        "link_mbs": link.throughput_mbs,
    }
    print("worker figures: " + ", ".join(f"{k} {v:.3g}" for k, v in figures.items() if v is not None))
    return figures


def cluster(figures: dict, ports: list[int]) -> list[Node]:
    coordinator_cpu = Device(
        "console",
        "CPU",
        "cpu",
        COORDINATOR_MIB * 2**20,
        COORDINATOR_MIB * 2**20,
        figures["bandwidth_gbs"],
        bandwidth_source="measured",
        prompt_gflops=figures["prompt_gflops"],
    )
    nodes = [
        Node(
            "console", "127.0.0.1", (coordinator_cpu,), coordinator=True, pass_overhead_ms=figures["pass_ms"]
        )
    ]
    for i, port in enumerate(ports):
        device = Device(
            f"w{i + 1}",
            "CPU",
            "cpu",
            4 * GIB,
            4 * GIB,
            figures["bandwidth_gbs"],
            bandwidth_source="measured",
            prompt_gflops=figures["prompt_gflops"],
        )
        nodes.append(
            Node(
                f"w{i + 1}",
                "127.0.0.1",
                (device,),
                rpc_port=port,
                rtt_ms=figures["rtt_ms"],
                hop_ms=figures["hop_ms"],
                link_mbs=figures["link_mbs"],
            )
        )
    return nodes


def run(bins, *, rounds: int, prompt_tokens: int, layers: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="ramdeck-first-word-"))
    servers = Servers(folder)
    try:
        ports = [_port(), _port()]
        for port in ports:
            proc = servers.start(
                [str(bins.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-d", "CPU", "-t", "1"],
                f"rpc-{port}",
            )
            _wait_port(port, proc)
        figures = calibrate(servers, bins, folder, ports[0])
        spec = TinyLlama(
            n_layer=layers, n_embd=1024, n_head=8, n_head_kv=2, n_ff=2816, n_ctx_train=4096, seed=21
        )
        model_path, _ = _calibration_model(folder, "model", spec)
        profile = profile_path(model_path)
        settings = Settings(ctx=max(2048, prompt_tokens + 64))
        nodes = cluster(figures, ports)
        plan = planner.plan(profile, nodes, settings)
        if not plan["fits"]:
            raise SystemExit("the plan does not fit: " + "; ".join(plan["warnings"]))
        layout = ", ".join(f"{p['node']} {p['layers']}" for p in plan["placements"] if p["layers"])
        base = ", ".join(f"{p['node']} {p['layers']}" for p in plan["baseline"]["placements"] if p["layers"])
        print(f"plan: {layout} blocks; llama.cpp's default: {base} blocks")
        if plan["prompt_option"]:
            option = plan["prompt_option"]
            other = ", ".join(f"{p['node']} {p['layers']}" for p in option["placements"] if p["layers"])
            print(f"offered for long prompts: {other} blocks")
        variants = {
            "plan": [*plan["llama_server_args"], "-t", "1"],
            **(
                {
                    "option": [
                        *planner.plan(profile, nodes, settings, objective="prompt")["llama_server_args"],
                        "-t",
                        "1",
                    ]
                }
                if plan["prompt_option"]
                else {}
            ),
            "default": [
                "--rpc",
                ",".join(f"127.0.0.1:{p}" for p in ports),
                "-ngl",
                "999",
                "--fit",
                "off",
                "-c",
                str(settings.ctx),
                "-t",
                "1",
            ],
        }
        measured: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "tps": []} for k in variants}
        for r in range(rounds):
            for name, args in variants.items():
                server = LlamaServer(servers, str(bins.llama_server), model_path, args, f"{name}-{r}")
                try:
                    ttft = [server.first_token_s(prompt_tokens) for _ in range(2)]
                    tps = server.decode_tps(128)
                finally:
                    server.stop()
                measured[name]["ttft"] += ttft
                measured[name]["tps"].append(tps)
                print(
                    f"round {r + 1} {name}: first token {', '.join(f'{t:.2f}' for t in ttft)} s, "
                    f"decode {tps:.1f} tok/s, load {server.load_s:.2f} s"
                )
        predicted = {
            "plan": ttft_at(plan["first_word"], prompt_tokens),
            "default": ttft_at(plan["baseline"]["first_word"], prompt_tokens),
        }
        if plan["prompt_option"]:
            predicted["option"] = ttft_at(plan["prompt_option"]["first_word"], prompt_tokens)
        med = {k: statistics.median(v["ttft"]) for k, v in measured.items()}
        tps = statistics.median(measured["plan"]["tps"])
        for name in variants:
            print(
                f"{name}: first token median {med[name]:.2f} s, predicted {predicted[name]:.2f} s "
                f"({(med[name] - predicted[name]) / predicted[name]:+.0%})"
            )
        print(f"plan decode median {tps:.1f} tok/s, predicted {plan['predicted_tokens_per_s']:.1f}")
        return {
            "ttft": {
                "plan_s": round(med["plan"], 3),
                "default_s": round(med["default"], 3),
                "pred_err": round((med["plan"] - predicted["plan"]) / predicted["plan"], 3),
                "default_pred_err": round((med["default"] - predicted["default"]) / predicted["default"], 3),
                # The split offered for long prompts (planned with objective=prompt), when one is.
                "option_s": round(med["option"], 3) if "option" in med else None,
                "option_pred_err": (
                    round((med["option"] - predicted["option"]) / predicted["option"], 3)
                    if "option" in med
                    else None
                ),
            },
            "decode": {
                "pred_err": round((tps - plan["predicted_tokens_per_s"]) / plan["predicted_tokens_per_s"], 3)
            },
        }
    finally:
        servers.stop_all()
        if not os.environ.get("RAMDECK_KEEP_BENCH_FILES"):
            subprocess.run(["rm", "-rf", str(folder)], check=False)
