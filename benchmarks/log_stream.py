"""Live log streaming, end to end: a job prints 100,000 lines; how fast and how late do they reach a browser?

Everything is real: the job runs through jobs.runner (in its own process, like a Celery worker) on the
local transport, lines are saved to a file-based SQLite database and sent through the Redis channel layer,
daphne serves the websocket consumer, and a `websockets` client logged in with a session cookie receives
them. Each line carries the time it left the emitting process; latency is arrival minus that.

    .venv/bin/python benchmarks/log_stream.py [--lines 100000] [--rate 25000]

`--rate` paces the emitter (lines per second; 0 = as fast as it can print). Targets: >= 20,000 lines/s
end to end, p95 <= 250 ms, nothing lost, every line stored. The last line printed is one JSON object.
Redis database 9 is used so the benchmark's groups never meet anyone else's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
LINE = re.compile(r'data-seq="\d+">L(\d+) (\d+\.\d+) ')

EMITTER = r"""
import sys, time
total, rate = int(sys.argv[1]), float(sys.argv[2])
chunk = 250
pad = "x" * 40  # A line about as long as a compiler's.
out = sys.stdout
start = time.time()
for first in range(0, total, chunk):
    if rate:
        delay = start + first / rate - time.time()
        if delay > 0:
            time.sleep(delay)
    out.write("".join(f"L{i} {time.time():.6f} {pad}\n" for i in range(first, min(total, first + chunk))))
    out.flush()
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"daphne did not listen on port {port} within {timeout:g} s")


def prepare(workdir: Path, lines: int, rate: float) -> tuple[int, str]:
    """Migrate a fresh database; create a viewer, the console's own node and the job. (job id, cookie)"""
    import django

    django.setup()
    from django.conf import settings
    from django.core.management import call_command
    from django.test import Client

    from jobs.models import Job
    from nodes.models import Node, Transport
    from tests.factories import UserFactory

    call_command("migrate", verbosity=0)
    user = UserFactory(username="bench-viewer", role="viewer")
    node = Node.objects.create(name="console-host", address="127.0.0.1", transport=Transport.LOCAL)
    emitter = workdir / "emit.py"
    emitter.write_text(EMITTER)
    job = Job.objects.create(
        kind="command", node=node, params={"argv": [PYTHON, str(emitter), str(lines), str(rate)]}
    )
    client = Client()
    client.force_login(user)
    return job.pk, client.cookies[settings.SESSION_COOKIE_NAME].value


async def watch(port: int, job_id: int, cookie: str, start_runner) -> tuple[dict[int, tuple], int]:
    """Connect, start the job, receive until the server closes: ({line: (sent, arrived)}, duplicates)."""
    import websockets

    url = f"ws://127.0.0.1:{port}/ws/jobs/{job_id}/?after=-1"
    headers = {"Cookie": f"sessionid={cookie}"}
    seen: dict[int, tuple[float, float]] = {}
    duplicates = 0
    async with websockets.connect(
        url, additional_headers=headers, origin=f"http://127.0.0.1:{port}", max_size=None
    ) as ws:
        await ws.recv()  # The status summary: connected, joined, backlog (empty) sent.
        start_runner()
        async for message in ws:
            arrived = time.time()
            for match in LINE.finditer(message):
                index = int(match.group(1))
                if index in seen:
                    duplicates += 1
                    continue
                seen[index] = (float(match.group(2)), arrived)
    return seen, duplicates


def cpu_seconds(pid: int) -> float:
    import psutil

    times = psutil.Process(pid).cpu_times()
    return round(times.user + times.system, 2)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=25_000, help="lines per second; 0 = unpaced burst")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="ramdeck-bench-"))
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "ramdeck_site.settings",
            "DATABASE_URL": f"sqlite:///{workdir / 'bench.sqlite3'}",
            "REDIS_URL": "redis://127.0.0.1:6379/9",
            "PYTHONUNBUFFERED": "1",
        }
    )
    sys.path.insert(0, str(ROOT))
    job_id, cookie = prepare(workdir, args.lines, args.rate)

    port = free_port()
    daphne_argv = [str(Path(PYTHON).with_name("daphne")), "-b", "127.0.0.1", "-p", str(port)]
    run = f"import django; django.setup(); from jobs.runner import run_job; run_job({job_id})"
    processes: list[subprocess.Popen] = []
    with open(workdir / "daphne.log", "wb") as daphne_log, open(workdir / "runner.log", "wb") as runner_log:
        processes.append(
            subprocess.Popen([*daphne_argv, "ramdeck_site.asgi:application"], cwd=ROOT, stderr=daphne_log)
        )

        def start_runner() -> None:
            processes.append(subprocess.Popen([PYTHON, "-c", run], cwd=ROOT, stderr=runner_log))

        try:
            wait_for_port(port)
            seen, duplicates = asyncio.run(watch(port, job_id, cookie, start_runner))
            processes[-1].wait(timeout=300)
            cpu = {"daphne": cpu_seconds(processes[0].pid), "client": cpu_seconds(os.getpid())}
            cpu["runner_and_job"] = round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime, 2)
        finally:
            for process in reversed(processes):
                if process.poll() is None:
                    process.terminate()
                    try:
                        process.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        process.kill()

    from jobs.models import Job, JobLogLine

    job = Job.objects.get(pk=job_id)
    stored = JobLogLine.objects.filter(job_id=job_id, stream="out").count()
    seqs = list(JobLogLine.objects.filter(job_id=job_id).order_by("seq").values_list("seq", flat=True))
    latencies = [(arrived - sent) * 1000 for sent, arrived in seen.values()]
    first_sent = min((sent for sent, _ in seen.values()), default=0.0)
    last_arrival = max((arrived for _, arrived in seen.values()), default=0.0)
    elapsed = max(last_arrival - first_sent, 1e-9)
    figures = {
        "lines": args.lines,
        "rate": args.rate,
        "lines_per_s": round(len(seen) / elapsed),
        "p50_ms": round(statistics.median(latencies), 1) if latencies else None,
        "p95_ms": round(percentile(latencies, 0.95), 1) if latencies else None,
        "max_ms": round(max(latencies), 1) if latencies else None,
        "lost": args.lines - len(seen),
        "duplicates": duplicates,
        "stored": stored,
        "seq_gap_free": seqs == list(range(len(seqs))),
        "job_state": job.state,
        "cpu_s": cpu,
    }
    print(f"{len(seen)} of {args.lines} lines arrived in {elapsed:.2f} s; job {job.state}; {stored} stored")
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
