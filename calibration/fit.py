"""The calibration's pure parts: the line through two runs' times (fixed cost and bandwidth), and the
CPU-time split of a run under a CPU quota."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

# The deep model must take measurably longer per token than the shallow one, else the difference is noise.
MIN_SLOWDOWN = 1.05


# A line whose fixed cost is more than this share of the shallow model's time explains too little by bytes.
MAX_FIXED_SHARE = 0.5


# Fewer CPU ticks (1/100 s each on Linux) than this between two readings say too little to split them.
MIN_SHARE_TICKS = 20


@dataclass(frozen=True)
class CalibrationModel:
    name: str
    local_path: str
    remote_name: str
    size_bytes: int
    read_bytes: int  # weights read per token: every block and the output layer (not the input embedding)
    # Prompt processing's work (planning/first_word.py): FLOPs per token of its blocks' matrices, per token
    # and position of their attention, and of the output layer once.
    matrix_flops: float = 0.0
    attention_flops: float = 0.0
    output_flops: float = 0.0

    def prompt_flops(self, tokens: int) -> float:
        """The work of an n-token prompt, the first token included (one ubatch, positions 1..n)."""
        return (
            self.matrix_flops * tokens + self.attention_flops * tokens * (tokens + 1) / 2 + self.output_flops
        )


@dataclass
class Run:
    """One llama-server launch: decode speed samples of one model on one device."""

    model: str
    read_bytes: int
    tokens_per_s: list[float]
    # On a node with a CPU quota: the rpc-servers' share of the CPU time the node spent on the samples
    # (theirs over theirs plus llama-server's), else None. See `device_seconds_per_token`.
    rpc_cpu_share: float | None = None
    # A prompt of `prompt_tokens` tokens processed at these speeds (timings.prompt_per_second), if asked.
    prompt_tokens: int | None = None
    prompt_per_s: list[float] | None = None

    @property
    def seconds_per_token(self) -> float:
        # The median sample: what the device does under the machine's usual load, as a deployment will
        # run (one disturbed sample does not move it).
        return 1.0 / statistics.median(self.tokens_per_s)

    @property
    def device_seconds_per_token(self) -> float:
        """What the device's rpc-servers take per token, as a deployment runs them (llama-server elsewhere).

        Under a CPU quota that binds, the node's time is the quota's: llama-server, which drives the
        calibration from the same node, spends part of it, so the wall time per token is that of both
        processes' CPU time together. In a deployment llama-server runs on the coordinator and the
        rpc-server has the quota to itself: its share of the wall time is its share of the CPU time.
        Without a share (no quota, or it could not be read) the wall time counts as it is.
        """
        share = 1.0 if self.rpc_cpu_share is None else self.rpc_cpu_share
        return self.seconds_per_token * share


def comparable(*runs: Run) -> list[float]:
    """Seconds per token of the runs, all on the same footing: the device's share of each when every run
    has one, else the wall times (a slope between a scaled and an unscaled time would mean nothing)."""
    if all(run.rpc_cpu_share is not None for run in runs):
        return [run.device_seconds_per_token for run in runs]
    return [run.seconds_per_token for run in runs]


@dataclass(frozen=True)
class FixedCosts:
    """What a token costs beyond reading weights, in milliseconds, measured with the tiny model on `device`:
    a pass inside llama-server on this node (`pass_ms`), what one rpc-server hop adds to it (`hop_ms`), and
    what splitting across two servers adds beyond their hops (`pipeline_ms`)."""

    device: str
    runs: list[dict]
    pass_ms: float | None
    hop_ms: float | None
    pipeline_ms: float | None


@dataclass(frozen=True)
class Line:
    """seconds per token = fixed_s + bytes / bandwidth_bps, through two runs."""

    bandwidth_bps: float | None  # None: the two runs could not be told apart (noise, or a very fast device)
    fixed_s: float


def fit(shallow: Run, deep: Run) -> Line:
    """The line through two runs. No bandwidth is claimed (and the whole time of the shallow run counts as
    fixed cost) when the deeper model is not clearly slower, or when the line would leave most of the
    shallow run's time unexplained by its bytes: then the runs were too disturbed to trust their slope (or
    the device is too fast for these models to tell)."""
    t_a, t_b = comparable(shallow, deep)
    if t_b < t_a * MIN_SLOWDOWN or deep.read_bytes <= shallow.read_bytes:
        return Line(None, t_a)
    bandwidth = (deep.read_bytes - shallow.read_bytes) / (t_b - t_a)
    fixed = t_a - shallow.read_bytes / bandwidth
    if fixed > MAX_FIXED_SHARE * t_a:
        return Line(None, t_a)
    return Line(bandwidth, max(0.0, fixed))


def cpu_ticks(stat_text: str) -> dict[int, int]:
    """User plus system CPU ticks by PID, from the text of /proc/PID/stat files one after the other."""
    ticks = {}
    for line in stat_text.splitlines():
        pid, _, rest = line.partition(" (")
        # The command name may hold spaces and parentheses: the fields go on after the last ") ".
        fields = rest.rpartition(") ")[2].split()
        if pid.strip().isdigit() and len(fields) > 12:
            ticks[int(pid)] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks


def rpc_share(before: dict[int, int] | None, after: dict[int, int] | None, llama_pid: int) -> float | None:
    """The rpc-servers' share of the CPU ticks spent between two readings (None: unknown or too few)."""
    if before is None or after is None or before.keys() != after.keys() or llama_pid not in after:
        return None
    used = {pid: after[pid] - before[pid] for pid in after}
    total = sum(used.values())
    # A negative count is another process under a reused PID; too few ticks say too little.
    if min(used.values()) < 0 or total < MIN_SHARE_TICKS:
        return None
    return round((total - used[llama_pid]) / total, 4)


def prompt_gflops(model: CalibrationModel, run: Run) -> float | None:
    """The device's prompt throughput in GFLOP/s: the model's work for the prompt over the median time the
    run took for it. None when the run measured no prompt."""
    if not run.prompt_tokens or not run.prompt_per_s or not model.matrix_flops:
        return None
    seconds = run.prompt_tokens / statistics.median(run.prompt_per_s)
    return round(model.prompt_flops(run.prompt_tokens) / seconds / 1e9, 2)
