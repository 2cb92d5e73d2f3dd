"""Tunnel against direct: what the SSH tunnel in front of ggml-rpc-server costs.

Runs tests/deployments/test_rpc_isolation.py::test_tunnel_and_direct_mode_both_serve_and_report_their_speed
(two lab hosts over real sshd: a coordinator and a worker holding part of a generated 8-layer GGUF model of
about 70 MiB; the console deploys it once in tunnel mode — rpc-server on 127.0.0.1, the coordinator through an
SSH local forward — and once in direct mode — rpc-server on the worker's LAN address behind its firewall
rule —, nine 64-token completions each) and reads the figures it prints. Model-load time is the
llama-server step: the model read and the worker's weights sent over RPC (the step polls /health every
0.5 s: that is its resolution). Needs root (the lab) and the cached llama.cpp build.
This machine's two cores are shared, so the figures move with its load; every sample is printed.

    .venv/bin/python benchmarks/rpc_modes.py [--rounds 1]

Ends with one JSON line: {"tunnel_decode_tps", "direct_decode_tps", "tunnel_load_s", "direct_load_s",
"rounds"} (medians over the rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics

from figures_of_test import figures_from_test

TEST = (
    "tests/deployments/test_rpc_isolation.py::test_tunnel_and_direct_mode_both_serve_and_report_their_speed"
)
KEYS = ("tunnel_decode_tps", "direct_decode_tps", "tunnel_load_s", "direct_load_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    rounds = [figures_from_test(TEST, "RPC-SPEED", timeout=900) for _ in range(args.rounds)]
    for i, figures in enumerate(rounds, start=1):
        for mode in ("tunnel", "direct"):
            samples = ", ".join(f"{v:.1f}" for v in figures[f"{mode}_decode_samples"])
            print(
                f"round {i} {mode:6s}: decode {figures[f'{mode}_decode_tps']:7.2f} tokens/s "
                f"(samples {samples}; measure step {figures[f'{mode}_measure_step_tps']:.1f}), "
                f"model load {figures[f'{mode}_load_s']:.2f} s"
            )
    summary = {key: round(statistics.median(r[key] for r in rounds), 3) for key in KEYS}
    tunnel, direct = summary["tunnel_decode_tps"], summary["direct_decode_tps"]
    print(f"tunnel decode is {tunnel / direct:.0%} of direct" if direct else "direct decode measured 0")
    print(json.dumps({**summary, "rounds": len(rounds)}))


if __name__ == "__main__":
    main()
