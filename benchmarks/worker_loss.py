"""Time from SIGKILL of the Celery worker in the middle of a launch to a consistent state (the deployment
failed with the step named, what it started ended, claims released, no job active), with the product's
defaults: the sweeper declares the run lost once its heartbeat is RAMDECK's STALE_AFTER_S (60 s) old and its
worker does not answer, then the control worker rolls it back. The test sweeps every second instead of
waiting for beat's interval (RAMDECK_SWEEP_INTERVAL_S, 60 s), which adds up to that much in production.

Runs tests/deployments/test_faults_deploy.py, its test of a worker killed during a launch,
on the lab (needs root and the llama.cpp build) and reads the figure it prints.

    .venv/bin/python benchmarks/worker_loss.py [--rounds 1]

Ends with one JSON line: {"worker_sigkill_to_consistent_s": median, "rounds": n}.
"""

from __future__ import annotations

import argparse
import json
import statistics

from figures_of_test import figures_from_test

TEST = (
    "tests/deployments/test_faults_deploy.py::"
    "test_the_worker_sigkilled_during_a_launch_ends_in_a_clean_failure"
)


def one_round() -> float:
    return figures_from_test(TEST, "FAULTS", timeout=1200)["worker_sigkill_to_consistent_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    figures = [one_round() for _ in range(args.rounds)]
    for i, value in enumerate(figures, 1):
        print(f"round {i}: {value:.1f} s from SIGKILL to consistent")
    print(json.dumps({"worker_sigkill_to_consistent_s": statistics.median(figures), "rounds": len(figures)}))


if __name__ == "__main__":
    main()
