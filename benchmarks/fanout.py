"""Probe fan-out: how long probing 8 lab hosts at once takes compared with probing one.

Each probe is what the probe job does over the network: an SSH connection with a pinned host key, the RTT
samples, and the one-round-trip probe script, parsed into a report. The hosts are network-namespace lab
machines with their own sshd (tests/lab), so this needs root. Target: ratio = eight_s / one_s <= 1.5.

    .venv/bin/python benchmarks/fanout.py [--hosts 8] [--rounds 5]

Measures routine probes (the node's llama.cpp build on record, as the probe job runs them) and first-contact
probes. Prints a line per round and ends with one JSON line: {"one_s": ..., "eight_s": ..., "ratio": ...,
"first_contact_ratio": ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ramdeck_site.settings")

import django

django.setup()

from llamacpp.logs import parse_server_version
from nodes.probe.collect import collect
from remote.ssh import SSHTarget, SSHTransport
from tests.lab.netlab import Lab, LabHost, cleanup_leftovers


async def probe_one(lab: Lab, host: LabHost, known_server: tuple[str, str] | None = None) -> int:
    target = SSHTarget(
        host=host.address,
        private_key=lab.client_private_key,
        pinned_host_key=host.host_public_key,
        connect_timeout=10,
    )
    async with SSHTransport(target) as transport:
        report = await collect(transport, "auto", known_server=known_server)
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


async def measure(lab: Lab, hosts: list[LabHost], rounds: int, known: tuple[str, str] | None) -> dict:
    def probe(host):
        return probe_one(lab, host, known)

    await asyncio.gather(*(probe(h) for h in hosts))  # Warm-up: page cache, sshd first fork.
    ones, eights, console, remote = [], [], [], []
    for n in range(rounds):
        one, _ = await timed(probe(hosts[n % len(hosts)]))
        before = node_cpu_s(hosts)
        eight, console_cpu = await timed(asyncio.gather(*(probe(h) for h in hosts)))
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


def known_build() -> tuple[str, str] | None:
    """(llama-server path, version) of the cached build the lab hosts share, as a node's Build row has it."""
    from tests.llamacpp_build import BUILD_ROOT

    found = sorted(BUILD_ROOT.glob("src-*/llama.cpp/build-*/bin/llama-server"))
    if not found:
        return None
    out = subprocess.run([str(found[0]), "--version"], capture_output=True, text=True, timeout=60)
    return str(found[0]), parse_server_version(out.stdout + out.stderr)


def figures_of(result: dict, hosts: int, cores: int, prefix: str = "") -> dict:
    # Every lab "machine" runs on this host's cores: the nodes' own work alone needs this long when all
    # probes run at once, whatever the console does.
    floor_s = hosts * result["node_cpu_per_probe_s"] / cores
    return {
        f"{prefix}one_s": round(result["one_s"], 4),
        f"{prefix}eight_s": round(result["eight_s"], 4),
        f"{prefix}ratio": round(result["eight_s"] / result["one_s"], 3),
        f"{prefix}console_cpu_s": round(result["console_cpu_s"], 4),
        f"{prefix}node_cpu_per_probe_s": round(result["node_cpu_per_probe_s"], 4),
        f"{prefix}shared_cpu_floor_s": round(floor_s, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    known = known_build()
    cleanup_leftovers()
    with Lab() as lab:
        hosts = [lab.add_host() for _ in range(args.hosts)]
        # Routine probes: the node's build is on record, as the probe job passes it (nodes/probe/job.py).
        print("routine probes (build on record):", flush=True)
        routine = asyncio.run(measure(lab, hosts, args.rounds, known))
        # First contact: nothing known yet, so the probe also asks llama-server for its version.
        print("first-contact probes:", flush=True)
        first = asyncio.run(measure(lab, hosts, args.rounds, None))
    figures = {
        **figures_of(routine, args.hosts, cores),
        "hosts": args.hosts,
        "rounds": args.rounds,
        "cores": cores,
        "build_on_record": known is not None,
        **figures_of(first, args.hosts, cores, prefix="first_contact_"),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
