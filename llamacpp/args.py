"""llama.cpp's command lines, as pure functions: the binaries' names, and the arguments of llama-server
and ggml-rpc-server for a plan."""

from __future__ import annotations

import bisect
import math
from typing import Any

import numpy as np

RPC_SERVER_BINARIES = ("ggml-rpc-server", "rpc-server")  # renamed upstream around mid-2026


LLAMA_SERVER_BINARY = "llama-server"


BINARIES = (*RPC_SERVER_BINARIES, LLAMA_SERVER_BINARY)


# llama.cpp's default physical batch (-ub), which the console passes only when a plan asks for another.
DEFAULT_UBATCH = 512


def layer_assignment(splits: list[float], n_layer: int, n_gpu_layers: int) -> list[int]:
    """Device index of each of the n_layer + 1 slots (blocks, then the output layer); -1 means the CPU.

    A faithful copy of llama_model_base::load_tensors: cumulative split fractions in float32, the first
    n_layer + 1 - ngl slots on the CPU, slot r of the offloaded ones on the first device whose cumulative
    fraction exceeds r / ngl.
    """
    n_dev = len(splits)
    cumulative = []
    total = np.float32(0.0)
    for share in splits:
        total = np.float32(total + np.float32(share))
        cumulative.append(total)
    fractions = [float(np.float32(c / total)) for c in cumulative] if total > 0 else [1.0] * n_dev
    start = max(n_layer + 1 - n_gpu_layers, 0)
    active = 0 if n_dev == 0 else min(n_gpu_layers, n_layer + 1)
    out = []
    for il in range(n_layer + 1):
        if il < start or il - start >= active:
            out.append(-1)
            continue
        value = float(np.float32(np.float32(il - start) / np.float32(active)))
        out.append(min(bisect.bisect_right(fractions, value), n_dev - 1))
    return out


def llama_server_args(placements: list[dict[str, Any]], settings: dict[str, Any], n_layer: int) -> list[str]:
    """Arguments to append after `-m MODEL` for a plan's placements (coordinator CPU first, then devices).

    `-ts` holds whole slot counts per listed device (the output layer counts as one slot of the last device),
    `-ngl` their sum, so llama.cpp places exactly the planned blocks. `--fit off` and an explicit `-c` stop
    llama.cpp from rewriting the plan. When the plan places a mixture of experts' routed experts
    (`expert_blocks`), one `-ot` rule per device holding some puts them there; a device that holds only
    experts is listed with a share of 0, so llama.cpp starts a backend for it and gives it no layer.
    """
    devices = [p for p in placements if p["llama_device"] != "CPU"]
    endpoints: list[str] = []
    for p in devices:
        if p["endpoint"] and p["endpoint"] not in endpoints:
            endpoints.append(p["endpoint"])
    shares = [p["layers"] + (1 if p["output_layer"] else 0) for p in devices]
    args: list[str] = []
    if endpoints:
        args += ["--rpc", ",".join(endpoints)]
    args += ["--device", ",".join(p["llama_device"] for p in devices) if devices else "none"]
    args += ["-ngl", str(sum(shares))]
    if devices:
        args += ["-ts", ",".join(str(s) for s in shares)]
    args += ["-sm", "layer", "-c", str(settings["ctx"]), "-np", str(settings["parallel"])]
    args += ["-ctk", settings["cache_type"], "-ctv", settings["cache_type"], "--fit", "off"]
    for p in placements:
        if p.get("expert_blocks"):
            args += ["-ot", expert_override(p["expert_blocks"], buffer_type(p))]
    if int(settings.get("ubatch", DEFAULT_UBATCH)) != DEFAULT_UBATCH:
        # The compute buffers were planned for this physical batch (planning/costs.py).
        args += ["-ub", str(settings["ubatch"])]
    return args


# llama.cpp's pattern for a block's routed experts (LLM_FFN_EXPS_REGEX in common/common.h, what --n-cpu-moe
# moves; llamacpp/gguf.py counts the same tensors).
EXPERTS_PATTERN = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def buffer_type(placement: dict[str, Any]) -> str:
    """The name of a placement's buffer type, as `-ot` takes it: `CPU`, a local device's own name (`CUDA0`,
    `Vulkan0`), or an RPC device's `RPC<index on its server>[<host:port>]` (ggml-rpc.cpp's
    ggml_backend_rpc_buffer_type), which exists once `--rpc` has added the server: `--rpc` comes first."""
    if placement.get("endpoint"):
        return f"RPC{placement.get('server_device_index', 0)}[{placement['endpoint']}]"
    return placement["llama_device"]


def block_ranges(blocks: list[int]) -> list[tuple[int, int]]:
    """Sorted block numbers as runs (first, last): [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    runs: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if runs and runs[-1][1] == b - 1:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((b, b))
    return runs


def expert_override(blocks: list[int], buffer: str) -> str:
    r"""An `-ot` rule putting the routed experts of `blocks` in `buffer`: `blk\.(10|11|12)\.ffn_…_exps=CPU`.

    The block numbers are listed one by one between `blk\.` and `\.`, so 1 never matches 10; the rule holds
    no comma, which llama.cpp would take for the next rule."""
    numbers = "|".join(str(b) for b in sorted(blocks))
    return rf"blk\.({numbers}){EXPERTS_PATTERN}={buffer}"


def rpc_server_args(host: str, port: int, devices: list[str], *, threads: int | None = None) -> list[str]:
    """Arguments for ggml-rpc-server. Devices are always named (`-d MTL0` keeps Apple machines on Metal)."""
    args = ["-H", host, "-p", str(port)]
    if devices:
        args += ["-d", ",".join(devices)]
    if threads:
        args += ["-t", str(threads)]
    return args


# How llama.cpp's CPU threads wait for work, so that a busy machine slows them in proportion instead of
# stalling them, and a quiet one is not slowed. The pinned build's CPU backend runs its threads under OpenMP
# (GGML_OPENMP, the default on Linux): between the operations of a token they meet at `#pragma omp barrier`,
# where libgomp spins before it sleeps (OMP_WAIT_POLICY unset: 300000 spins, about 3 ms), and llama-server's
# own threadpool busy-polls between graphs too (`--poll`, 50 by default). When another program holds one of
# the cores, the thread that shares it is preempted while its partners spin for their whole time slice at
# every barrier: decode fell from 50 to 1.3 tokens/s with one core taken (issue 19). Sleeping at once
# (OMP_WAIT_POLICY=passive, what the console used first) cures that but pays a futex wake-up at each of the
# hundreds of barriers of a token: on this two-core VM, idle, the small real model decoded 48 tokens/s
# passive against 106 to 146 spinning, and the cost per barrier made a narrow model's bytes look slower than
# a wide one's (calibration under-predicted deployments by 30%). A short spin, 200 rounds (a few
# microseconds), covers the wait of a barrier on a quiet machine and still sleeps when a partner is
# preempted: 106/121 tokens/s quiet and 52/53 with a burner on one of the two cores (through an rpc-server /
# inside llama-server), in proportion to the cores left; 1000 rounds gave 30 busy, 5000 gave 10
# (benchmarks/busy_machine.py). `--poll 0` makes the threadpool sleep between graphs: once a graph, cheap.
QUIET_WAIT_ENV = {"GOMP_SPINCOUNT": "200"}


def cpu_threads(
    cores: int | None, *, threads_per_core: int | None = None, quota_cores: float | None = None
) -> int | None:
    """How many threads llama.cpp's CPU work gets on a node: its physical cores (decode is bound by memory
    bandwidth, which a core's second hardware thread does not add to), of those the node may use (the probe
    counts the CPUs its affinity allows), and no more than a CPU quota that binds allows (a thread per whole
    core of quota, at least one: more threads than the quota's cores only wait for each other's time).
    None when the probe found no cores: llama.cpp then decides."""
    if not cores or cores < 1:
        return None
    threads = max(1, int(cores) // max(1, int(threads_per_core or 1)))
    if quota_cores and 0 < quota_cores < threads:
        threads = max(1, math.ceil(quota_cores))
    return threads


def node_cpu_threads(facts: dict[str, Any] | None) -> int | None:
    """`cpu_threads` from a node's probed facts (`cpu_cores`, `cpu_threads_per_core`, `cpu_quota_cores`)."""
    facts = facts or {}
    return cpu_threads(
        facts.get("cpu_cores"),
        threads_per_core=facts.get("cpu_threads_per_core"),
        quota_cores=facts.get("cpu_quota_cores"),
    )


def _has(args: list[str], *flags: str) -> bool:
    return any(a in flags or any(a.startswith(f"{f}=") for f in flags if f.startswith("--")) for a in args)


def quiet_llama_server_args(args: list[str], threads: int | None) -> list[str]:
    """A plan's llama-server arguments with the threads' waiting and count set for a shared machine:
    `--poll 0` (no busy-polling between tokens) and `-t` from the node's cores, unless already there."""
    args = list(args)
    if not _has(args, "--poll"):
        args += ["--poll", "0"]
    if threads and not _has(args, "-t", "--threads"):
        args += ["-t", str(threads)]
    return args


def quiet_rpc_server_args(args: list[str], threads: int | None) -> list[str]:
    """ggml-rpc-server's arguments with `-t` from the node's cores, unless already there (its own default is
    half the machine's hardware threads, whatever the node may use)."""
    args = list(args)
    if threads and not _has(args, "-t", "--threads"):
        args += ["-t", str(threads)]
    return args


def quiet_argv(argv: list[str], platform: str = "linux") -> list[str]:
    """argv started through `env` with `QUIET_WAIT_ENV` (POSIX env execs the program in place, so the PID
    the launcher reports is the program's own). A Windows node's argv is left as it is (no `env` there)."""
    if platform == "windows":
        return list(argv)
    quiet = [f"{k}={v}" for k, v in QUIET_WAIT_ENV.items()]
    if argv and argv[0] == "env":  # already started through env (the RPC cache's LLAMA_CACHE): one env
        return ["env", *quiet, *argv[1:]]
    return ["env", *quiet, *argv]


def llama_server_launch_argv(
    binary: str,
    model_path: str,
    plan_args: list[str],
    *,
    threads: int | None,
    alias: str,
    host: str,
    port: int,
    key_file: str,
    platform: str = "linux",
) -> list[str]:
    """The whole command line llama-server is started with: the plan's arguments, the threads' waiting and
    count for a shared machine (`quiet_llama_server_args`), the console's own options (alias, endpoint, the
    API key's file, metrics, log level) and the environment (`quiet_argv`). The deploy step runs it and the
    plan and deployment pages show it, so what is shown is what runs."""
    argv = [
        binary,
        "-m",
        model_path,
        *quiet_llama_server_args(plan_args, threads),
        # The OpenAI-style API answers to the model's name in the console, not to its file path.
        "--alias",
        model_alias(alias),
        "--host",
        host,
        "--port",
        str(port),
        "--api-key-file",
        key_file,
        "--metrics",
        "-lv",
        "4",
    ]
    return quiet_argv(argv, platform)


def model_alias(name: str) -> str:
    """The `--alias` for a model the console calls `name`. llama-server splits the option at commas (several
    aliases; the API answers with the first in sort order), so a name stays one alias."""
    alias = " ".join(name.replace(",", " ").split())
    return alias or "model"
