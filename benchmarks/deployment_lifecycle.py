"""Phase times of a whole deployment on the lab, and measured vs predicted tokens/s.

Runs the end-to-end test
(tests/deployments/test_e2e_deployment.py::test_build_plan_deploy_complete_verify_stop: three lab hosts over
real sshd, the console's build job from the llama.cpp tarball — cached by source hash —, a generated 8-layer
GGUF model split over two rpc-servers, deploy, completion, verify, stop) and reads the figures it prints.
Needs root (the lab) and the cached llama.cpp build.

    .venv/bin/python benchmarks/deployment_lifecycle.py [--rounds 3]

Prints a line per phase and ends with one JSON line: {"deploy_s", "stop_s", "build_s", "decode_tps",
"prompt_tps", "predicted_tps", "rounds"} (medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics

from figures_of_test import figures_from_test

TEST = "tests/deployments/test_e2e_deployment.py::test_build_plan_deploy_complete_verify_stop"


def one_round() -> dict:
    return figures_from_test(TEST, "E2E", timeout=900)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rounds = [one_round() for _ in range(args.rounds)]
    phases = rounds[-1]["phase_seconds"]
    for name in phases:
        values = [r["phase_seconds"][name] for r in rounds if name in r["phase_seconds"]]
        listing = ", ".join(f"{v:.2f}" for v in values)
        print(f"{name:32s} median {statistics.median(values):7.2f} s   (rounds: {listing})")

    def median(key: str, source: str = "") -> float | None:
        values = [(r["phase_seconds"] if source else r).get(key) for r in rounds]
        values = [v for v in values if v is not None]
        return round(statistics.median(values), 3) if values else None

    figures = {
        "deploy_s": median("deploy total", "phases"),
        "stop_s": median("stop", "phases"),
        "build_s": median("build (all three)", "phases"),
        "decode_tps": median("measured_decode_tps"),
        "prompt_tps": median("measured_prompt_tps"),
        "predicted_tps": median("predicted_tps"),
        "rounds": len(rounds),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
