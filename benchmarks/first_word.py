"""From Deploy to the first word (issue 20): the load part — bytes and seconds a deploy spends sending a
worker its weights, cold and warm.

Runs tests/deployments/test_rpc_cache_lab.py (two lab hosts over real sshd: a coordinator and a worker whose
ggml-rpc-server the console starts with its tensor cache; a generated model of about `--model-mib` MiB shaped
like a real one, few wide f16 blocks whose weight tensors are 2.5 to 34 MiB; the worker's link limited to
`--link-mbit` with a tc token bucket) and reads the figures it prints: the bytes the worker's veth received
during a cold deploy and a warm one (`rx_bytes` in its namespace), the llama-server step's time for each,
the worker's weights (llama-server's RPC model buffer), and the same model loaded from local disk by one
llama-server. Needs root (the lab), `tc` with the kernel's sch_tbf, and the cached llama.cpp build.

    .venv/bin/python benchmarks/first_word.py [--link-mbit 100] [--model-mib 512] [--rounds 1]

The test also deploys a third time with the worker holding its own copy of the model (copied by the console's
copy job) and its cache emptied: the fill step cuts the worker's tensors out of its copy into its cache before
rpc-server starts (modelfiles/cache_fill.py), and the bytes received are counted the same way.

The first-token part (benchmarks/first_word_ttft.py, over loopback on this machine: two rpc-servers, the
figures measured as calibration measures them, the plan against llama.cpp's default split for a
`--prompt-tokens` prompt, `--ttft-rounds` times each in alternation, medians) fills `ttft` and
`decode.pred_err`. `--skip-load` runs it alone (the load part takes minutes at 100 Mbit/s), `--skip-ttft` the
load part alone.

    .venv/bin/python benchmarks/first_word.py --skip-load [--ttft-rounds 3] [--prompt-tokens 2000]

Ends with one JSON line in the shape the issue asks for. What was not measured (a part that was skipped) is
null.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path

from figures_of_test import figures_from_test

TEST = (
    "tests/deployments/test_rpc_cache_lab.py::"
    "test_a_warm_deploy_sends_the_worker_only_what_its_rpc_cache_cannot_hold"
)


def local_copy_line(f: dict) -> str:
    """The loads with the worker holding its own copy: right after the copy job, whose last step filled the
    worker's cache with the whole model from it (`local_copy_s`: the deploy's fill step, which finds every
    tensor there, plus llama-server's load), and from an emptied cache, filled by the deploy's own step
    (`refill_s`: that fill plus the load)."""
    return (
        f"  local copy: {f['local_copy_s']:.2f} s ({f['local_copy_filling_s']:.2f} s of checking the cache), "
        f"{f['local_copy_bytes'] / 2**20:.1f} MiB received ({f['local_copy_fraction']:.2%} of its weights); "
        f"the copy job took {f['copy_s']:.1f} s once, {f['copy_fill_s']:.1f} s of it filling the cache\n"
        f"  local copy, cache emptied, filled by the deploy: {f['refill_s']:.2f} s "
        f"({f['refill_filling_s']:.2f} s of filling), {f['refill_bytes'] / 2**20:.1f} MiB "
        f"received ({f['refill_fraction']:.2%})"
    )


def prediction_lines(f: dict) -> str:
    """Each deploy's load as the measure step set it beside the plan's prediction (cold or warm, by what
    the console knows of the worker: a load before, or a registered copy), on the link calibration
    measured."""
    link = f["link_measured"]
    lines = [
        f"  predicted against measured (the link calibrated at {link['mbs']:.1f} MB/s, "
        f"{link['rtt_ms']:.2f} ms):"
    ]
    for run in ("cold", "warm", "local_copy", "refill"):
        first = f.get(f"{run}_first_word") or {}
        if first.get("load_predicted_s") is None:
            lines.append(f"    {run}: no prediction")
            continue
        lines.append(
            f"    {run}: load {first['load_s']:.2f} s ({first['load_kind']}) against "
            f"{first['load_predicted_s']:.2f} s ({first['load_error']:+.0%})"
        )
    return "\n".join(lines)


def _load_errors(rounds: list[dict]) -> dict:
    """The median load prediction error of each kind of deploy over the rounds."""
    out = {}
    for run in ("cold", "warm", "local_copy"):
        errors = [(r.get(f"{run}_first_word") or {}).get("load_error") for r in rounds]
        errors = [e for e in errors if e is not None]
        out[f"{run}_pred_err"] = round(statistics.median(errors), 3) if errors else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-mbit", type=float, default=100.0, help="0: no rate limit")
    parser.add_argument("--model-mib", type=float, default=512.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--skip-load", action="store_true", help="only the first-token part")
    parser.add_argument("--skip-ttft", action="store_true", help="only the load part")
    parser.add_argument("--ttft-rounds", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--ttft-layers", type=int, default=4, help="blocks of the first-token part's model")
    args = parser.parse_args()
    if args.ttft_rounds < 1 or args.prompt_tokens < 16 or args.ttft_layers < 2:
        raise SystemExit("--ttft-rounds must be at least 1, --prompt-tokens 16, --ttft-layers 2")
    first = {"ttft": {"plan_s": None, "default_s": None, "pred_err": None}, "decode": {"pred_err": None}}
    if not args.skip_ttft:
        from first_word_ttft import run as ttft_run

        from tests.llamacpp_build import llamacpp_binaries

        first = ttft_run(
            llamacpp_binaries(),
            rounds=args.ttft_rounds,
            prompt_tokens=args.prompt_tokens,
            layers=args.ttft_layers,
        )
    load = dict.fromkeys(
        [
            "cold_s",
            "warm_s",
            "local_copy_s",
            "cold_bytes",
            "warm_bytes",
            "local_copy_bytes",
            "weights_bytes",
            "local_disk_s",
        ]
    )
    if not args.skip_load:
        load = load_part(args)
    print(f"load average: {Path('/proc/loadavg').read_text().strip()}")
    print(json.dumps({"load": load, **first}))


def load_part(args) -> dict:
    if args.link_mbit and not shutil.which("tc"):
        raise SystemExit("tc is not installed: run with --link-mbit 0 to measure without a rate limit")
    os.environ["RAMDECK_FIRST_WORD_LINK_MBIT"] = str(args.link_mbit)
    os.environ["RAMDECK_FIRST_WORD_MODEL_MIB"] = str(args.model_mib)
    rounds = [figures_from_test(TEST, "FIRST-WORD", timeout=3600) for _ in range(args.rounds)]
    for i, f in enumerate(rounds, start=1):
        link = f"{f['link_mbit']:g} Mbit/s" if f["link_mbit"] else "unlimited"
        print(
            f"round {i}: link {link}, {f['n_layer']} blocks, worker weights "
            f"{f['weights_bytes'] / 2**20:.1f} MiB ({f['cacheable_fraction']:.1%} of them above the "
            f"cache threshold)\n"
            f"  cold: {f['cold_s']:.2f} s, {f['cold_bytes'] / 2**20:.1f} MiB received by the worker\n"
            f"  warm: {f['warm_s']:.2f} s, {f['warm_bytes'] / 2**20:.1f} MiB received "
            f"({f['warm_fraction']:.2%} of its weights; target under 5%)\n"
            f"  local disk, one machine: {f['local_disk_s']:.2f} s\n"
            f"  (the llama-server steps, SSH and placement check included: cold {f['cold_step_s']:.2f} s, "
            f"warm {f['warm_step_s']:.2f} s)"
        )
        print(local_copy_line(f))
        print(prediction_lines(f))

    def median(key: str):
        return round(statistics.median(r[key] for r in rounds), 3)

    return {
        "cold_s": median("cold_s"),
        "warm_s": median("warm_s"),
        "local_copy_s": median("local_copy_s"),
        "cold_bytes": int(median("cold_bytes")),
        "warm_bytes": int(median("warm_bytes")),
        "local_copy_bytes": int(median("local_copy_bytes")),
        "weights_bytes": int(median("weights_bytes")),
        "local_disk_s": median("local_disk_s"),
        "refill_s": median("refill_s"),
        "refill_bytes": int(median("refill_bytes")),
        "copy_s": median("copy_s"),
        **_load_errors(rounds),
    }


if __name__ == "__main__":
    main()
