"""From Deploy to the first word (issue 20): the load part — bytes and seconds a deploy spends sending a
worker its weights, cold and warm.

Runs tests/deployments/test_rpc_cache_lab.py (two lab hosts over real sshd: a coordinator and a worker whose
ggml-rpc-server the console starts with its tensor cache; a generated model of about `--model-mib` MiB shaped
like a real one, few wide f16 blocks whose weight tensors are 12.5 to 34 MiB; the worker's link limited to
`--link-mbit` with a tc token bucket) and reads the figures it prints: the bytes the worker's veth received
during a cold deploy and a warm one (`rx_bytes` in its namespace), the llama-server step's time for each,
the worker's weights (llama-server's RPC model buffer), and the same model loaded from local disk by one
llama-server. Needs root (the lab), `tc` with the kernel's sch_tbf, and the cached llama.cpp build.

    .venv/bin/python benchmarks/first_word.py [--link-mbit 100] [--model-mib 512] [--rounds 1]

The test also deploys a third time with the worker holding its own copy of the model (copied by the console's
copy job) and its cache emptied: the fill step cuts the worker's tensors out of its copy into its cache before
rpc-server starts (modelfiles/local_copy.py), and the bytes received are counted the same way.

Ends with one JSON line in the shape the issue asks for. What this part does not measure is null: the whole
`ttft` and `decode` parts (no first-token prediction exists yet).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics

from figures_of_test import figures_from_test

TEST = (
    "tests/deployments/test_rpc_cache_lab.py::"
    "test_a_warm_deploy_sends_the_worker_only_what_its_rpc_cache_cannot_hold"
)


def local_copy_line(f: dict) -> str:
    """The load with the worker holding its own copy (its cache emptied, then filled from the copy before its
    rpc-server started): `local_copy_s` is the fill plus the llama-server step."""
    return (
        f"  local copy: {f['local_copy_s']:.2f} s (the worker's cache filled from its copy in "
        f"{f['fill_s']:.2f} s of it), {f['local_copy_bytes'] / 2**20:.1f} MiB received "
        f"({f['local_copy_fraction']:.2%} of its weights; {f['uncacheable_bytes'] / 2**20:.1f} MiB of them "
        f"are under the threshold); the copy itself took {f['copy_s']:.1f} s once"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--link-mbit", type=float, default=100.0, help="0: no rate limit")
    parser.add_argument("--model-mib", type=float, default=512.0)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.link_mbit and not shutil.which("tc"):
        raise SystemExit("tc is not installed: run with --link-mbit 0 to measure without a rate limit")
    os.environ["RAMDECK_FIRST_WORD_LINK_MBIT"] = str(args.link_mbit)
    os.environ["RAMDECK_FIRST_WORD_MODEL_MIB"] = str(args.model_mib)
    rounds = [figures_from_test(TEST, "FIRST-WORD", timeout=3600) for _ in range(args.rounds)]
    for i, f in enumerate(rounds, start=1):
        link = f"{f['link_mbit']:g} Mbit/s" if f["link_mbit"] else "unlimited"
        print(
            f"round {i}: link {link}, {f['n_layer']} blocks, worker weights "
            f"{f['weights_bytes'] / 2**20:.1f} MiB ({f['cacheable_fraction']:.1%} of them above the 10 MiB "
            f"cache threshold)\n"
            f"  cold: {f['cold_s']:.2f} s, {f['cold_bytes'] / 2**20:.1f} MiB received by the worker\n"
            f"  warm: {f['warm_s']:.2f} s, {f['warm_bytes'] / 2**20:.1f} MiB received "
            f"({f['warm_fraction']:.2%} of its weights; target under 5%)\n"
            f"  local disk, one machine: {f['local_disk_s']:.2f} s"
        )
        print(local_copy_line(f))

    def median(key: str):
        return round(statistics.median(r[key] for r in rounds), 3)

    load = {
        "cold_s": median("cold_s"),
        "warm_s": median("warm_s"),
        "local_copy_s": median("local_copy_s"),
        "cold_bytes": int(median("cold_bytes")),
        "warm_bytes": int(median("warm_bytes")),
        "local_copy_bytes": int(median("local_copy_bytes")),
        "weights_bytes": int(median("weights_bytes")),
        "local_disk_s": median("local_disk_s"),
    }
    print(
        json.dumps(
            {
                "load": load,
                "ttft": {"plan_s": None, "default_s": None, "pred_err": None},
                "decode": {"pred_err": None},
            }
        )
    )


if __name__ == "__main__":
    main()
