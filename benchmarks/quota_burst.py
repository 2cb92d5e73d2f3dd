"""What a CPU quota's periods give a worker that waits between tokens, against `Slot.quota_time`.

The lab makes a worker slow with a cgroup CPU quota (tests/lab/netlab.py `throttle_cpu`: 10% of a core as
1 ms of CPU per 10 ms period). Calibration measures that worker's steady pace (work ÷ quota); in a
deployment it waits while the others compute their part of the token, then runs its own at full speed until
the period's quota is spent. The speed model takes one period off its steady time for that, never going
below the work at full speed (planning/costs.py `Slot.quota_time`).

This checks that term on its own, without llama.cpp: a child process in a cgroup v1 `cpu` group with the
lab's quota and period (one thread, as the console starts a worker held to less than a core) sleeps, then
burns a fixed amount of CPU time (a token's work at full speed), again and again, and the wall time of each
burn is measured:

- **random phase**: the sleep has a random part as long as a period, so each burn starts anywhere in a
  period. The median against `quota_time`'s figure and against the steady pace.
- **fixed phase**: the same sleep every time, for sleeps one millisecond apart. A deployment's token is a
  cycle (the worker's part, then the others'), so where its part starts in the quota's period repeats from
  token to token: the spread between these medians is how far one deployment's speed can sit from another's
  of the same split with the same work, by phase alone.

    sudo .venv/bin/python benchmarks/quota_burst.py [--samples 60]

Needs root and the cgroup v1 `cpu` controller at /sys/fs/cgroup/cpu (as the lab does). Ends with one JSON
line: {"random_phase": [{"quota", "work_ms", "steady_ms", "model_ms", "measured_ms", "model_err",
"steady_err"}, ...], "fixed_phase": [{"quota", "work_ms", "sleep_ms", "measured_ms"}, ...],
"fixed_phase_spread": {quota: [min_ms, max_ms]}, "model_err_median", "steady_err_median", "load"}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planning.costs import Slot
from tests.lab.netlab import CGROUP_CPU_ROOT

PERIOD_US = 10_000  # the lab's period (benchmarks/split_speed.py, tests/calibration)
QUOTAS = (0.1, 0.3, 0.5)
WORK_MS = (0.5, 1.5, 2.5, 4.0, 7.0)
SLEEP_MS = 20.0  # the others' part of the token: two periods and more

# The child: SAMPLES times, sleep (a fixed part and, with jitter, a random part up to a period), then burn
# WORK ms of its own CPU time; prints each burn's wall time in ms.
CHILD = """
import random, sys, time
work, sleep, jitter, samples = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
random.seed(7)
out = []
for _ in range(samples):
    time.sleep((sleep + random.uniform(0, jitter)) / 1000)
    start, cpu = time.monotonic(), time.thread_time()
    while time.thread_time() - cpu < work / 1000:
        pass
    out.append((time.monotonic() - start) * 1000)
print(" ".join(f"{x:.3f}" for x in out))
"""


def model_ms(quota: float, steady_ms: float) -> float:
    """`Slot.quota_time` for a worker with the lab's period and `quota` cores (the real method, on a stand-in
    holding only the two fields it reads)."""
    slot = SimpleNamespace(burst_s=PERIOD_US / 1e6, quota_cores=quota)
    return float(Slot.quota_time(slot, steady_ms / 1000)) * 1000


def burn(group: Path, work: float, sleep: float, jitter: float, samples: int) -> float:
    """The median wall time (ms) of `samples` burns of `work` ms of CPU inside the cgroup."""
    script = f'echo $$ > {group / "cgroup.procs"}; exec {sys.executable} -c "$0" "$@"'
    argv = ["sh", "-c", script, CHILD, str(work), str(sleep), str(jitter), str(samples)]
    result = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=600)
    return statistics.median(float(x) for x in result.stdout.split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=60, help="burns per measurement (median kept)")
    args = parser.parse_args()
    if not (CGROUP_CPU_ROOT / "cpu.cfs_quota_us").is_file():
        raise SystemExit(f"the cgroup v1 cpu controller is not mounted at {CGROUP_CPU_ROOT} (needs root)")
    group = CGROUP_CPU_ROOT / f"ramdeck-quota-burst-{os.getpid()}"
    group.mkdir()
    random_phase, fixed_phase, spread = [], [], {}
    try:
        (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        for quota in QUOTAS:
            (group / "cpu.cfs_quota_us").write_text(str(round(PERIOD_US * quota)))
            for work in WORK_MS:
                steady = work / quota
                measured = burn(group, work, SLEEP_MS, PERIOD_US / 1000, args.samples)
                model = model_ms(quota, steady)
                row = {"quota": quota, "work_ms": work, "steady_ms": round(steady, 2),
                       "model_ms": round(model, 2), "measured_ms": round(measured, 2),
                       "model_err": round((model - measured) / measured, 3),
                       "steady_err": round((steady - measured) / measured, 3)}  # fmt: skip
                random_phase.append(row)
                print(f"quota {quota:.0%}, {work} ms of work: steady {steady:6.1f} ms, model {model:6.1f}, "
                      f"measured {measured:6.1f} (model {row['model_err']:+.0%}, steady "
                      f"{row['steady_err']:+.0%})", flush=True)  # fmt: skip
            work = 2.5 if quota < 0.5 else 4.0  # more than one period's quota: the phase decides
            medians = []
            for offset in range(round(PERIOD_US / 1000)):
                sleep = SLEEP_MS + offset
                measured = burn(group, work, sleep, 0.0, max(20, args.samples // 3))
                medians.append(measured)
                fixed_phase.append({"quota": quota, "work_ms": work, "sleep_ms": sleep,
                                    "measured_ms": round(measured, 2)})  # fmt: skip
            spread[str(quota)] = [round(min(medians), 2), round(max(medians), 2)]
            print(f"quota {quota:.0%}, {work} ms of work, fixed sleeps {SLEEP_MS:.0f}..{sleep:.0f} ms: "
                  f"{', '.join(f'{m:.1f}' for m in medians)} ms "
                  f"(model {model_ms(quota, work / quota):.1f})", flush=True)  # fmt: skip
    finally:
        # The child processes have ended; an empty group can go.
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    summary = {
        "random_phase": random_phase,
        "fixed_phase": fixed_phase,
        "fixed_phase_spread": spread,
        "model_err_median": round(statistics.median(abs(r["model_err"]) for r in random_phase), 3),
        "steady_err_median": round(statistics.median(abs(r["steady_err"]) for r in random_phase), 3),
        "load": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
