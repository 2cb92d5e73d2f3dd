"""Probe fan-out: how long probing 8 lab hosts at once takes compared with probing one.

Each probe is what the probe job does over the network: an SSH connection with a pinned host key, the RTT
samples, and the one-round-trip probe script, parsed into a report. The hosts are network-namespace lab
machines with their own sshd (tests/lab), so this needs root. Target: ratio = eight_s / one_s <= 1.5.

    .venv/bin/python benchmarks/fanout.py [--hosts 8] [--rounds 5]

Prints a line per round and ends with one JSON line: {"one_s": ..., "eight_s": ..., "ratio": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ramdeck_site.settings")

import django  # noqa: E402

django.setup()

from jobs.ssh import SSHTarget, SSHTransport  # noqa: E402
from nodes.probing import collect  # noqa: E402
from tests.lab.netlab import Lab, LabHost, cleanup_leftovers  # noqa: E402


async def probe_one(lab: Lab, host: LabHost) -> int:
    target = SSHTarget(
        host=host.address,
        private_key=lab.client_private_key,
        pinned_host_key=host.host_public_key,
        connect_timeout=10,
    )
    async with SSHTransport(target) as transport:
        report = await collect(transport, "auto")
    if not report.devices:
        raise RuntimeError(f"probe of {host.address} found no device")
    return len(report.devices)


def node_cpu_s(hosts: list[LabHost]) -> float:
    """CPU seconds used on the lab hosts so far: each sshd listener's own and its reaped children's
    (sessions, the probe script and everything it ran)."""
    total = 0
    for host in hosts:
        fields = Path(f"/proc/{host.sshd_pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
    return total / os.sysconf("SC_CLK_TCK")


async def timed(coro) -> tuple[float, float]:
    """(wall seconds, console CPU seconds)."""
    start, cpu = time.perf_counter(), time.process_time()
    await coro
    return time.perf_counter() - start, time.process_time() - cpu


async def measure(lab: Lab, hosts: list[LabHost], rounds: int) -> dict:
    await asyncio.gather(*(probe_one(lab, h) for h in hosts))  # Warm-up: page cache, sshd first fork.
    ones, eights, console, remote = [], [], [], []
    for n in range(rounds):
        one, _ = await timed(probe_one(lab, hosts[n % len(hosts)]))
        before = node_cpu_s(hosts)
        eight, console_cpu = await timed(asyncio.gather(*(probe_one(lab, h) for h in hosts)))
        remote.append((node_cpu_s(hosts) - before) / len(hosts))
        ones.append(one)
        eights.append(eight)
        console.append(console_cpu)
        print(
            f"round {n + 1}: one {one * 1000:.0f} ms, {len(hosts)} at once {eight * 1000:.0f} ms "
            f"(console CPU {console_cpu * 1000:.0f} ms, node CPU per probe {remote[-1] * 1000:.0f} ms)",
            flush=True,
        )
    return {
        "one_s": statistics.median(ones),
        "eight_s": statistics.median(eights),
        "console_cpu_s": statistics.median(console),
        "node_cpu_per_probe_s": statistics.median(remote),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cleanup_leftovers()
    with Lab() as lab:
        hosts = [lab.add_host() for _ in range(args.hosts)]
        result = asyncio.run(measure(lab, hosts, args.rounds))
    cores = len(os.sched_getaffinity(0))
    one_s, eight_s = result["one_s"], result["eight_s"]
    # Every lab "machine" runs on this host's cores: the nodes' own work alone needs this long when all
    # probes run at once, whatever the console does.
    floor_s = args.hosts * result["node_cpu_per_probe_s"] / cores
    figures = {
        "one_s": round(one_s, 4),
        "eight_s": round(eight_s, 4),
        "ratio": round(eight_s / one_s, 3),
        "hosts": args.hosts,
        "rounds": args.rounds,
        "cores": cores,
        "console_cpu_s": round(result["console_cpu_s"], 4),
        "node_cpu_per_probe_s": round(result["node_cpu_per_probe_s"], 4),
        "shared_cpu_floor_s": round(floor_s, 4),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
