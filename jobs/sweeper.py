"""Jobs whose worker died: find them, say so, and end what they left running on the node.

A running job beats its heartbeat every few seconds (jobs/runner.py). A job is lost when its heartbeat is
stale AND its worker does not answer a Celery ping (or the heartbeat is so old that no live worker can
explain it). A worker that starts again under the same hostname also declares lost every job it owned
before it started: whatever ran them is gone. A lost job becomes `errored` ("worker lost"); the process
it recorded (`remote_pid`) is ended through the node's transport, unless the job's kind leaves daemons it
started running on purpose (adoption), in which case the process is left alone and the log says so.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q
from django.utils import timezone

from . import broadcast
from .models import Job, JobState, LogStream
from .transport import TransportError

logger = logging.getLogger(__name__)

# A heartbeat older than this (seconds) makes a job a suspect; the runner beats every 5 s, and a
# SQLite database busy with another writer can hold a beat back for its 20 s timeout.
STALE_AFTER_S = 60.0
# Older than this, the job is lost even if its worker still answers pings (its runner is wedged).
HOPELESS_AFTER_S = 600.0
# Kinds whose recorded process is a daemon meant to outlive the job (ggml-rpc-server, llama-server):
# a lost launch is reported, and its daemon is adopted instead of killed. A job may say otherwise with
# params["adopt_on_loss"].
ADOPT_KINDS = frozenset({"launch"})


def alive_workers(timeout: float = 1.0) -> set[str] | None:
    """Hostnames of the Celery workers that answer a ping; None when the broker cannot be asked."""
    from ramdeck_site.celery import app

    try:
        # A connection of its own, closed afterwards: a pooled one would keep the reply queue's pending
        # read, and a process forked later (Celery's prefork children, a test's live server) would wait
        # on it when kombu closes inherited connections after the fork.
        with app.connection_for_write() as connection:
            replies = app.control.ping(timeout=timeout, connection=connection) or []
    except Exception as exc:  # noqa: BLE001 - an unreachable broker must not stop the sweep.
        logger.warning("Could not ping Celery workers: %s", exc)
        return None
    return {name for reply in replies for name in reply}


def sweep(
    *,
    stale_after: float = STALE_AFTER_S,
    hopeless_after: float = HOPELESS_AFTER_S,
    alive: set[str] | None = None,
    ping: bool = True,
) -> list[int]:
    """Declare lost the running jobs nobody is running any more; return their ids."""
    now = timezone.now()
    suspects = list(
        Job.objects.select_related("node", "node__credential").filter(
            Q(heartbeat_at__lt=now - timedelta(seconds=stale_after)) | Q(heartbeat_at__isnull=True),
            state=JobState.RUNNING,
        )
    )
    if not suspects:
        return []
    if alive is None and ping:
        alive = alive_workers()
    lost = []
    for job in suspects:
        age = (now - (job.heartbeat_at or job.started_at or job.created_at)).total_seconds()
        worker_gone = alive is None or job.worker not in alive
        if worker_gone or age > hopeless_after:
            why = f"worker {job.worker or '?'} stopped answering" if worker_gone else "its runner stopped"
            if abandon(job, f"Worker lost: {why} (no heartbeat for {age:.0f} s)."):
                lost.append(job.pk)
    return lost


def sweep_own_jobs(hostname: str, started_before: datetime) -> list[int]:
    """On worker start: every job this hostname was running before it started is lost."""
    lost = []
    jobs = Job.objects.select_related("node", "node__credential").filter(
        state=JobState.RUNNING, worker=hostname, started_at__lt=started_before
    )
    for job in jobs:
        if abandon(job, f"Worker lost: {hostname} restarted while the job was running."):
            lost.append(job.pk)
    return lost


def abandon(job: Job, reason: str) -> bool:
    """Mark a running job errored with `reason`, then deal with its remote process. True if it was ours
    to mark (a racing runner or sweeper may have finished it first)."""
    if not job.finish(JobState.ERRORED, result=reason):
        return False
    logger.warning("Job %s: %s", job.pk, reason)
    notes = [reason]
    if job.remote_pid:
        notes += _deal_with_remote_process(job)
    rows = job.append_lines([(LogStream.SYSTEM, note) for note in notes])
    broadcast.send_lines_sync(job.pk, rows)
    broadcast.send_status_sync(job.pk, job.state)
    return True


def wants_adoption(job: Job) -> bool:
    return bool(job.params.get("adopt_on_loss", job.kind in ADOPT_KINDS))


def _deal_with_remote_process(job: Job) -> list[str]:
    from .runner import run_to_completion, with_own_db_thread

    pid = job.remote_pid
    where = job.node_name or "the console's host"
    try:
        end = not wants_adoption(job)
        alive, ended = run_to_completion(lambda: with_own_db_thread(_check_and_end(job, pid, end=end)))
    except TransportError as exc:
        return [f"Could not reach {where} to end process {pid}: {exc}"]
    except Exception as exc:  # noqa: BLE001 - the job is already marked; report, do not crash the sweep.
        logger.exception("Job %s: ending process %s failed", job.pk, pid)
        return [f"Could not end process {pid} on {where}: {type(exc).__name__}: {exc}"]
    if not alive:
        return [f"Process {pid} on {where} had already exited."]
    if ended is None:
        return [f"Process {pid} on {where} is still running and was adopted (left running on purpose)."]
    if ended:
        return [f"Ended process {pid} on {where}."]
    return [f"Process {pid} on {where} did not end after TERM and KILL; check the machine."]


async def _check_and_end(job: Job, pid: int, *, end: bool) -> tuple[bool, bool | None]:
    from .runner import open_transport_for

    async with await open_transport_for(job.node) as transport:
        if not await transport.pid_alive(pid) or not await _is_the_jobs_process(transport, job, pid):
            return False, None
        if not end:
            return True, None
        return True, await transport.kill(pid, grace=settings.RAMDECK_KILL_GRACE_S)


# Slack for the heartbeat interval and the time `ps` takes: a process younger than "since the last
# heartbeat" by more than this cannot be the one the job started.
PID_AGE_SLACK_S = 30.0


async def _is_the_jobs_process(transport, job: Job, pid: int) -> bool:
    """False when the PID now belongs to a newer process (the job's own ended and the PID was reused).

    The job's process was alive at its last heartbeat (a runner that saw it end would have finished the
    job), so it is at least that old. `ps -o etime=` reports a process's age on Linux and macOS alike and,
    unlike a start timestamp, does not depend on the node's clock agreeing with the console's.
    """
    result = await transport.run(["ps", "-o", "etime=", "-p", str(int(pid))], timeout=30)
    age = parse_etime(result.stdout)
    if age is None:
        return True  # Cannot tell: treat it as the job's, as before.
    last_seen = job.heartbeat_at or job.started_at or job.created_at
    return age + PID_AGE_SLACK_S >= (timezone.now() - last_seen).total_seconds()


def parse_etime(text: str) -> int | None:
    """`ps -o etime=` ([[dd-]hh:]mm:ss) in seconds, or None when it is not that."""
    text = text.strip()
    if not text:
        return None
    days, _, clock = text.rpartition("-")
    try:
        parts = [int(part) for part in clock.split(":")]
        seconds = 0
        for part in parts:
            seconds = seconds * 60 + part
        return seconds + (int(days) * 86400 if days else 0)
    except ValueError:
        return None
