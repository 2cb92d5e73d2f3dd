"""Load: 30 logged-in people browse the console while 5 jobs stream their logs to websocket watchers.

The real stack, as `make run` starts it (ramdeck_site/management/commands/console.py's process list): daphne
serving the ASGI application, the two Celery workers and beat, a real Redis, a file-based SQLite database (or
DATABASE_URL). The database holds a household-and-then-some inventory: 40 nodes with devices, 400 finished
jobs with logs, 10 deployments and 4,000 audit entries. 5 command jobs on the console's own node print
`--lines` lines each at `--rate` lines/s; one websocket client per job (a viewer, `ws/jobs/<pk>/`) counts
the lines it receives. Meanwhile 30 users (httpx, each with its own session) fetch the dashboard, node,
deployment and job pages with a think time between clicks, until every job has ended.

    .venv/bin/python benchmarks/load.py [--users 30] [--jobs 5] [--lines 2000] [--rate 100] [--think 1.0]

Targets: p95 page latency < 200 ms, no error responses, every log line delivered. The last line printed is
one JSON object. Uses REDIS_URL when set (else redis://127.0.0.1:6379/9) and a temporary var/ folder.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
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
SEQ = re.compile(r'data-seq="(\d+)"')

EMITTER = r"""
import sys, time
total, rate = int(sys.argv[1]), float(sys.argv[2])
start = time.time()
for i in range(total):
    delay = start + i / rate - time.time()
    if delay > 0:
        time.sleep(delay)
    print(f"line {i} of a compiler-like log, about as long as the real ones: " + "x" * 40, flush=True)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"daphne did not listen on port {port} within {timeout:g} s")


def prepare(workdir: Path, users: int, jobs: int, lines: int, rate: float) -> dict:
    """Migrate; create the users (sessions), the inventory and the streaming jobs (not yet queued)."""
    import django

    django.setup()
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import Group
    from django.core.management import call_command
    from django.test import Client
    from django.urls import reverse
    from django.utils import timezone

    from audit.models import AuditEvent
    from deployments.models import Deployment, DeploymentState
    from jobs.models import Job, JobLogLine, JobState
    from modelfiles.models import ModelFile
    from nodes.models import Device, DeviceKind, Node, Reachability, Transport

    User = get_user_model()
    call_command("migrate", verbosity=0)
    call_command("collectstatic", interactive=False, verbosity=0)
    now = timezone.now()
    viewers = Group.objects.get(name="viewer")
    people = [User.objects.create(username=f"person-{i}", password="!") for i in range(users + 1)]
    viewers.user_set.add(*people)
    watcher = people.pop()
    local = Node.objects.create(name="console-host", address="127.0.0.1", transport=Transport.LOCAL)
    nodes = Node.objects.bulk_create(
        Node(
            name=f"node-{i}",
            address=f"10.9.{i // 250}.{i % 250 + 2}",
            ssh_user="root",
            reachability=Reachability.REACHABLE,
            last_seen_at=now,
        )
        for i in range(40)
    )
    Device.objects.bulk_create(
        Device(
            node=node, name=name, kind=kind, total_bytes=16 * 2**30, free_bytes=12 * 2**30, bandwidth_gbs=40
        )
        for node in nodes
        for name, kind in (("CPU", DeviceKind.CPU), ("CUDA0", DeviceKind.CUDA))
    )
    history = Job.objects.bulk_create(
        Job(
            kind="command",
            node=node,
            node_name=node.name,
            title=f"uptime on {node.name}",
            state=JobState.SUCCEEDED,
            started_at=now,
            finished_at=now,
            exit_code=0,
        )
        for node in nodes
        for _ in range(10)
    )
    JobLogLine.objects.bulk_create(
        JobLogLine(job=job, seq=i, text=f"log line {i}") for job in history[:50] for i in range(200)
    )
    deployments = []
    for i, node in enumerate(nodes[:10]):
        model = ModelFile.objects.create(name=f"model-{i}", node=node, path=f"/models/m{i}.gguf", profile={})
        deployments.append(
            Deployment.objects.create(
                name=f"deployment {i}",
                model_file=model,
                coordinator=node,
                plan={},
                state=DeploymentState.RUNNING,
            )
        )
    AuditEvent.objects.bulk_create(
        AuditEvent(
            actor_name="alice",
            action="node.update",
            object_type="node",
            object_id=str(node.pk),
            object_repr=node.name,
            changes={"notes": ["", "x"]},
        )
        for node in nodes
        for _ in range(100)
    )
    emitter = workdir / "emit.py"
    emitter.write_text(EMITTER)
    streaming = [
        Job.objects.create(
            kind="command",
            node=local,
            title=f"stream {j}",
            params={"argv": [PYTHON, str(emitter), str(lines), str(rate)]},
        )
        for j in range(jobs)
    ]

    def cookie(user) -> str:
        client = Client()
        client.force_login(user)
        return client.cookies[settings.SESSION_COOKIE_NAME].value

    pages = [
        reverse("dashboard"),
        reverse("nodes:list"),
        reverse("jobs:list"),
        reverse("deployments:list"),
        reverse("audit"),
        reverse("modelfiles:list"),
    ]
    pages += [reverse("nodes:detail", args=[n.name]) for n in nodes[:10]]
    pages += [reverse("deployments:run", args=[d.pk]) for d in deployments]
    pages += [reverse("jobs:detail", args=[j.pk]) for j in streaming + history[:10]]
    return {
        "cookies": [cookie(p) for p in people],
        "watcher": cookie(watcher),
        "jobs": [j.pk for j in streaming],
        "pages": pages,
        "cookie_name": settings.SESSION_COOKIE_NAME,
    }


async def watch(port: int, job_id: int, cookie: str, cookie_name: str, ready: asyncio.Event) -> set[int]:
    """Receive a job's log until the server closes the socket: the set of line seqs seen."""
    import websockets

    url = f"ws://127.0.0.1:{port}/ws/jobs/{job_id}/?after=-1"
    seen: set[int] = set()
    async with websockets.connect(
        url,
        additional_headers={"Cookie": f"{cookie_name}={cookie}"},
        origin=f"http://127.0.0.1:{port}",
        max_size=None,
        open_timeout=60,
    ) as ws:
        ready.set()
        async for message in ws:
            seen.update(int(s) for s in SEQ.findall(message))
    return seen


async def browse(
    client, pages: list[str], think: float, stop: asyncio.Event, results: list[tuple[float, int, str]]
) -> None:
    import httpx

    rng = random.Random(id(client))
    await asyncio.sleep(rng.uniform(0, think))  # people do not all arrive in the same millisecond
    while not stop.is_set():
        page = rng.choice(pages)
        started = time.perf_counter()
        try:
            response = await client.get(page)
            status = response.status_code
        except httpx.HTTPError as exc:
            status = f"{type(exc).__name__}"
        results.append(((time.perf_counter() - started) * 1000, status, page))
        await asyncio.sleep(rng.expovariate(1 / think) if think else 0)


async def run_load(port: int, data: dict, think: float, enqueue) -> tuple[list, list[set[int]], float]:
    import httpx

    results: list[tuple[float, int, str]] = []
    stop = asyncio.Event()
    readies = [asyncio.Event() for _ in data["jobs"]]
    watchers = [
        asyncio.create_task(watch(port, pk, data["watcher"], data["cookie_name"], ready))
        for pk, ready in zip(data["jobs"], readies, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 60)
    # Plain HTTP: no TLS context per client (loading the CA bundle 30 times would stall this event loop
    # and count against the console's latency).
    clients = [
        httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}",
            cookies={data["cookie_name"]: cookie},
            timeout=60,
            follow_redirects=False,
            verify=False,
        )
        for cookie in data["cookies"]
    ]
    people = [asyncio.create_task(browse(client, data["pages"], think, stop, results)) for client in clients]
    started = time.monotonic()
    await asyncio.to_thread(enqueue)
    seen = await asyncio.gather(*watchers)
    elapsed = time.monotonic() - started
    stop.set()
    await asyncio.gather(*people)
    for client in clients:
        await client.aclose()
    return results, seen, elapsed


def cpu_seconds(pid: int, *, children: bool = True) -> float:
    """User and system CPU seconds of a process and (by default) its children (Celery's pool processes)."""
    import psutil

    process = psutil.Process(pid)
    total = 0.0
    for each in [process, *(process.children(recursive=True) if children else [])]:
        try:
            times = each.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return round(total, 1)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=30)
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--lines", type=int, default=2000, help="lines each streaming job prints")
    parser.add_argument("--rate", type=float, default=100, help="lines per second of each streaming job")
    parser.add_argument("--think", type=float, default=1.0, help="mean seconds between one person's clicks")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="ramdeck-load-"))
    os.environ.update(
        {
            "DJANGO_SETTINGS_MODULE": "ramdeck_site.settings",
            "RAMDECK_VAR_DIR": str(workdir / "var"),
            "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/9"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    os.environ.setdefault("DATABASE_URL", f"sqlite:///{workdir / 'load.sqlite3'}")
    sys.path.insert(0, str(ROOT))
    data = prepare(workdir, args.users, args.jobs, args.lines, args.rate)
    import logging

    # httpcore tries `import sniffio` on every request; without sniffio installed each failed import searches
    # sys.path again (about 1 ms of this client's CPU per request). Settle it once: there is no sniffio.
    sys.modules.setdefault("sniffio", None)
    import httpx  # noqa: F401  (imported before the clock starts)
    import websockets  # noqa: F401

    logging.getLogger("httpx").setLevel(logging.WARNING)

    from ramdeck_site.management.commands.console import console_processes

    port = free_port()
    processes: list[subprocess.Popen] = []
    names: list[str] = []
    logs = []
    try:
        for line in console_processes("127.0.0.1", port, concurrency=args.jobs):
            name, command = line.split(": ", 1)
            names.append(name)
            log = open(workdir / f"{name}.log", "wb")  # noqa: SIM115 (closed below)
            logs.append(log)
            processes.append(subprocess.Popen(shlex.split(command), cwd=ROOT, stdout=log, stderr=log))
        wait_for_port(port)
        load_before = os.getloadavg()

        def enqueue() -> None:
            from jobs.models import Job

            for job in Job.objects.filter(pk__in=data["jobs"]):
                job.enqueue()

        client_before = cpu_seconds(os.getpid(), children=False)
        results, seen, elapsed = asyncio.run(run_load(port, data, args.think, enqueue))
        load_after = os.getloadavg()
        # CPU each process used: the web server's share against the time says how close it ran to one core.
        cpu = {name: cpu_seconds(process.pid) for name, process in zip(names, processes, strict=True)}
        cpu["load_client"] = round(cpu_seconds(os.getpid(), children=False) - client_before, 1)
    finally:
        for process in reversed(processes):
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        for log in logs:
            log.close()

    from jobs.models import Job, JobLogLine

    states = list(Job.objects.filter(pk__in=data["jobs"]).values_list("state", flat=True))
    stored = JobLogLine.objects.filter(job_id__in=data["jobs"]).count()
    latencies = [ms for ms, _, _ in results]
    errors = [(status, page) for _, status, page in results if not isinstance(status, int) or status >= 400]
    by_kind: dict[str, list[float]] = {}
    for ms, _, page in results:
        by_kind.setdefault(re.sub(r"/[^/]*\d[^/]*/", "/N/", page), []).append(ms)
    slowest = sorted(results, key=lambda r: -r[0])[:3]
    figures = {
        "p95_ms": round(percentile(latencies, 0.95), 1),
        "p50_ms": round(statistics.median(latencies), 1) if latencies else None,
        "max_ms": round(max(latencies), 1) if latencies else None,
        "requests": len(results),
        "requests_per_s": round(len(results) / elapsed, 1),
        "errors": len(errors),
        "error_samples": errors[:5],
        # Every stored line is sent through the channel layer (the jobs' own lines and the runner's few).
        "lines_sent": stored,
        "lines_printed": args.jobs * args.lines,
        "lines_delivered": sum(len(s) for s in seen),
        "job_states": sorted(set(states)),
        "users": args.users,
        "jobs": args.jobs,
        "seconds": round(elapsed, 1),
        "p95_ms_by_page": {kind: round(percentile(ms, 0.95), 1) for kind, ms in sorted(by_kind.items())},
        "slowest": [[round(ms), page] for ms, _, page in slowest],
        "cpu_s": cpu,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "cpus": os.cpu_count(),
        "database": "postgresql" if os.environ["DATABASE_URL"].startswith("postgres") else "sqlite",
    }
    print(
        f"{len(results)} page loads by {args.users} people in {elapsed:.1f} s; "
        f"{figures['lines_delivered']} of {figures['lines_sent']} log lines delivered"
    )
    shutil.rmtree(workdir, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
