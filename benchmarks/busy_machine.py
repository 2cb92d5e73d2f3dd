"""A busy machine: llama.cpp's decode speed with another program holding one core, old command against new.

On this machine, with the small real model (SmolLM2-135M-Instruct, llamacpp/real_model.py) and the pinned
llama.cpp build in the per-user cache (tests/prepare_llamacpp.py builds it), for two layouts

    local   llama-server computes on its own CPU (a coordinator that holds layers)
    rpc     ggml-rpc-server computes on the CPU, llama-server drives it over loopback (a worker)

and two command lines

    old     what the console started before: the plan's arguments only (llama.cpp's threads and polling)
    new     what it starts now (llamacpp/args.py): GOMP_SPINCOUNT=200, `--poll 0` for llama-server,
            `-t` from this machine's physical cores (the probe's figures, `cpu_threads`)
    passive what it started in between: the same with OMP_WAIT_POLICY=passive (threads sleep at once at
            every barrier) instead of the short spin

decode tokens/s is measured quiet and busy: each sample a fixed length (`ignore_eos`, --tokens, 128 by
default) from an empty cache, --repeats samples per state, the median compared. "Busy" is a CPU burner this
script starts beside the servers (`python -c 'while 1: pass'`, pinned to CPU --burner-cpu, -1 for not
pinned) and ends by its PID after the samples. The machine's load average is printed with every state: the
machine is shared, so "quiet" means "without the burner", not idle.

    .venv/bin/python benchmarks/busy_machine.py [--layout local|rpc|both] [--repeats 5] [--tokens 128]
                                                [--burner-cpu 0] [--sample-timeout 300]

Ends with one JSON line: {"load_before", "threads", "results": [{"layout", "command", "quiet_tps",
"busy_tps", "busy_ratio", "quiet_samples", "busy_samples", "load_quiet", "load_busy"}, ...]}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llamacpp.args import (
    cpu_threads,
    llama_server_args,
    quiet_argv,
    quiet_llama_server_args,
    quiet_rpc_server_args,
    rpc_server_args,
)
from llamacpp.real_model import fetch_real_model
from nodes.probe.parse import threads_per_core

CACHE = Path(os.environ.get("RAMDECK_CACHE_DIR") or Path.home() / ".cache" / "ramdeck")
PROMPT = "The quick brown fox jumps over the lazy dog. Tell me a short story about a fox:"
SETTINGS = {"ctx": 4096, "parallel": 1, "cache_type": "f16"}
N_LAYER = 30  # SmolLM2-135M's blocks
COMMANDS = ("old", "passive", "new")


def build_bin() -> Path:
    found = sorted(CACHE.glob("llama.cpp/src-*/llama.cpp/build-cpu/bin/llama-server"))
    if not found:
        sys.exit(f"no llama.cpp build under {CACHE}: run .venv/bin/python -m tests.prepare_llamacpp first")
    return found[-1].parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def this_machines_threads() -> int | None:
    """What the console would give a node like this one: the probe's affinity-aware CPU count and its
    threads per core from /proc/cpuinfo."""
    cores = len(os.sched_getaffinity(0))
    return cpu_threads(cores, threads_per_core=threads_per_core(Path("/proc/cpuinfo").read_text()))


def load() -> float:
    return round(os.getloadavg()[0], 2)


class Procs:
    """The processes this script starts, each ended by its own PID (its process group: env execs in place)."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self.logdir = Path(tempfile.mkdtemp(prefix="ramdeck-busy-"))

    def start(self, argv: list[str], name: str, preexec=None) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=preexec,
        )  # fmt: skip
        self.pids.append(proc.pid)
        return proc

    def end(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if proc.pid in self.pids:
            self.pids.remove(proc.pid)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{proc.args[0]} exited with {proc.returncode} while loading")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    sys.exit(f"llama-server at {url} was not healthy within {timeout:.0f} s")


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"rpc-server exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    sys.exit(f"rpc-server did not listen on {port}")


def decode(url: str, tokens: int, timeout: float) -> float | None:
    body = {"prompt": PROMPT, "n_predict": tokens, "ignore_eos": True, "cache_prompt": False}
    try:
        answer = httpx.post(f"{url}/completion", json=body, timeout=timeout).json()
    except httpx.TimeoutException:
        return None  # slower than tokens / timeout: counted as 0 in the median, said in the samples
    timings = answer["timings"]
    if timings["predicted_n"] != tokens:
        sys.exit(f"asked for {tokens} tokens, llama-server decoded {timings['predicted_n']}")
    return round(timings["predicted_per_second"], 2)


def commands(layout: str, command: str, binaries: Path, model: Path, threads: int | None, ports: dict):
    """(rpc-server argv or None, llama-server argv) for one layout and command."""
    new = command != "old"
    tail = ["--host", "127.0.0.1", "--port", str(ports["http"])]
    rpc_argv = None
    if layout == "local":
        args = llama_server_args([], SETTINGS, N_LAYER)
    else:
        endpoint = f"127.0.0.1:{ports['rpc']}"
        placement = {"llama_device": "RPC0", "endpoint": endpoint, "layers": N_LAYER, "output_layer": True}
        args = llama_server_args([placement], SETTINGS, N_LAYER)
        rpc_args = [*rpc_server_args("127.0.0.1", ports["rpc"], ["CPU"]), "-c"]
        rpc_args = quiet_rpc_server_args(rpc_args, threads) if new else rpc_args
        rpc_argv = [str(binaries / "ggml-rpc-server"), *rpc_args]
        rpc_argv = with_wait(rpc_argv, command)
    args = quiet_llama_server_args(args, threads) if new else args
    llama_argv = [str(binaries / "llama-server"), "-m", str(model), *args, *tail]
    return rpc_argv, with_wait(llama_argv, command)


def with_wait(argv: list[str], command: str) -> list[str]:
    """argv with the command's environment for the threads' waiting."""
    if command == "passive":
        return ["env", "OMP_WAIT_POLICY=passive", *argv]
    return quiet_argv(argv) if command == "new" else argv


def burner(cpu: int) -> list[str]:
    pin = f"import os; os.sched_setaffinity(0, {{{cpu}}})\n" if cpu >= 0 else ""
    return [sys.executable, "-c", f"{pin}while 1: pass"]


def measure(procs: Procs, layout: str, command: str, args, binaries: Path, model: Path, threads) -> dict:
    ports = {"http": free_port(), "rpc": free_port()}
    rpc_argv, llama_argv = commands(layout, command, binaries, model, threads, ports)
    print(f"\n== {layout} / {command}", flush=True)
    rpc = None
    if rpc_argv:
        print("   $ " + " ".join(rpc_argv), flush=True)
        rpc = procs.start(rpc_argv, f"{layout}-{command}-rpc")
        wait_port(ports["rpc"], rpc)
    print("   $ " + " ".join(llama_argv), flush=True)
    server = procs.start(llama_argv, f"{layout}-{command}-llama")
    url = f"http://127.0.0.1:{ports['http']}"
    row: dict = {"layout": layout, "command": command, "argv": llama_argv, "rpc_argv": rpc_argv}
    try:
        wait_healthy(url, server)
        decode(url, 8, args.sample_timeout)  # warm-up
        for state in ("quiet", "busy"):
            hog = procs.start(burner(args.burner_cpu), "burner") if state == "busy" else None
            try:
                if hog:
                    time.sleep(1.0)
                row[f"load_{state}"] = load()
                samples = [decode(url, args.tokens, args.sample_timeout) for _ in range(args.repeats)]
                row[f"load_{state}"] = max(row[f"load_{state}"], load())
            finally:
                if hog:
                    procs.end(hog)
            row[f"{state}_samples"] = samples
            row[f"{state}_tps"] = round(statistics.median(s or 0.0 for s in samples), 2)
            print(
                f"   {state:5s} median {row[f'{state}_tps']:6.1f} tok/s  samples {samples}  "
                f"load {row[f'load_{state}']}",
                flush=True,
            )
    finally:
        procs.end(server)
        if rpc:
            procs.end(rpc)
    row["busy_ratio"] = round(row["busy_tps"] / row["quiet_tps"], 3) if row.get("quiet_tps") else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layout", choices=["local", "rpc", "both"], default="both")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--burner-cpu", type=int, default=0, help="CPU the burner is pinned to; -1: not")
    parser.add_argument("--sample-timeout", type=float, default=300.0)
    args = parser.parse_args()
    binaries = build_bin()
    model = fetch_real_model(CACHE, log=lambda m: print(m, file=sys.stderr))
    threads = this_machines_threads()
    before = load()
    print(f"model {model.name}; build {binaries}; new command's threads: {threads}; load {before}")
    layouts = ["local", "rpc"] if args.layout == "both" else [args.layout]
    procs = Procs()
    results = []
    try:
        for layout in layouts:
            for command in COMMANDS:
                results.append(measure(procs, layout, command, args, binaries, model, threads))
    finally:
        for pid in list(procs.pids):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    print("\nlayout  command   quiet tok/s   busy tok/s   busy/quiet")
    for r in results:
        ratio = r["busy_ratio"]
        quiet = r["quiet_tps"]
        print(f"{r['layout']:7s} {r['command']:7s} {quiet:11.1f} {r['busy_tps']:12.1f} {ratio!s:>12}")
    keep = ["layout", "command", "quiet_tps", "busy_tps", "busy_ratio", "quiet_samples", "busy_samples"]
    summary = [{k: r[k] for k in [*keep, "load_quiet", "load_busy"]} for r in results]
    print(json.dumps({"load_before": before, "threads": threads, "results": summary}))


if __name__ == "__main__":
    main()
