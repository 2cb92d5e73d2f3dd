"""Jobs whose worker died or whose message was lost: find them, say so, and end what they left running.

A running job beats its heartbeat every few seconds (jobs/runner.py). A job is lost when its heartbeat is
stale AND its worker does not answer a Celery ping (or the process that ran it, on this host, is gone; or
the heartbeat is so old that no live worker can explain it). A worker that starts again under the same
hostname also declares lost every job it owned before it started: whatever ran them is gone. A lost job
becomes `errored` ("worker lost"), and so do its running steps; the process it recorded (`remote_pid`) is
ended through the node's transport, unless the job's kind leaves daemons it started running on purpose
(adoption), in which case the process is left alone and the log says so. Then the kind's `on_lost` hook
tells the app that owns it (`on_end`, jobs/kinds.py).

A queued job whose task message is in no queue of the broker (a Redis restart, a publish that failed) is
sent again; one that stays queued past `RAMDECK_QUEUED_GIVE_UP_S` is errored ("never started") instead.
"""

from __future__ import annotations

import json
import logging
import socket
from datetime import datetime, timedelta

import psutil
from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone

from jobs import broadcast, kinds
from jobs.aio import open_transport_for, run_to_completion, with_own_db_thread
from jobs.models import RUN_TASK, Job, JobState, LogStream
from ramdeck_site.celery import app
from remote.base import TransportError

logger = logging.getLogger(__name__)

# A heartbeat older than this (seconds) makes a job a suspect; the runner beats every 5 s, and a
# SQLite database busy with another writer can hold a beat back for its 20 s timeout.
STALE_AFTER_S = 60.0
# Older than this, the job is lost even if its worker still answers pings (its runner is wedged).
HOPELESS_AFTER_S = 600.0


def alive_workers(timeout: float = 1.0) -> set[str] | None:
    """Hostnames of the Celery workers that answer a ping; None when the broker cannot be asked."""

    try:
        # A connection of its own, closed afterwards: a pooled one would keep the reply queue's pending
        # read, and a process forked later (Celery's prefork children, a test's live server) would wait
        # on it when kombu closes inherited connections after the fork.
        with app.connection_for_write() as connection:
            replies = app.control.ping(timeout=timeout, connection=connection) or []
    except Exception as exc:
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
        Job.objects.select_related("node")
        .filter(
            Q(heartbeat_at__lt=now - timedelta(seconds=stale_after)) | Q(heartbeat_at__isnull=True),
            state=JobState.RUNNING,
        )
        .order_by(F("parent_id").asc(nulls_first=True), "pk")  # Parents first: each takes its steps along.
    )
    if not suspects:
        return []
    if alive is None and ping:
        alive = alive_workers()
    lost = []
    for job in suspects:
        job.refresh_from_db(fields=["state"])  # A parent swept just before may have taken its steps along.
        if job.state != JobState.RUNNING:
            continue
        reason = lost_reason(
            job, alive=alive, stale_after=stale_after, hopeless_after=hopeless_after, now=now
        )
        if reason and abandon(job, reason):
            lost.append(job.pk)
    return lost


def lost_reason(
    job: Job,
    *,
    alive: set[str] | None,
    stale_after: float = STALE_AFTER_S,
    hopeless_after: float = HOPELESS_AFTER_S,
    now: datetime | None = None,
) -> str:
    """Why a running job is lost ("" when it is not): a stale heartbeat, and a worker that does not answer
    (`alive` is None when nobody could be asked), or a runner process on this host that is gone, or a
    heartbeat too old for any live worker to explain."""
    now = now or timezone.now()
    age = (now - (job.heartbeat_at or job.started_at or job.created_at)).total_seconds()
    if age < stale_after:
        return ""
    worker_gone = alive is None or job.worker not in alive
    if not worker_gone and runner_died_here(job):
        why = f"the process running it on {job.worker} (PID {job.runner_pid}) died"
    elif worker_gone or age > hopeless_after:
        why = f"worker {job.worker or '?'} stopped answering" if worker_gone else "its runner stopped"
    else:
        return ""
    return f"Worker lost: {why} (no heartbeat for {age:.0f} s)."


def is_lost(job: Job, *, stale_after: float = STALE_AFTER_S) -> bool:
    """One job, checked now (a caller waiting for it): is it running with nobody running it?"""
    job.refresh_from_db()
    if job.state != JobState.RUNNING:
        return False
    age = (timezone.now() - (job.heartbeat_at or job.started_at or job.created_at)).total_seconds()
    if age < stale_after:
        return False
    return bool(lost_reason(job, alive=alive_workers(), stale_after=stale_after))


def sweep_one(job: Job, *, stale_after: float = STALE_AFTER_S) -> bool:
    """Declare one job lost if it is; True when it was."""
    reason = lost_reason(job, alive=alive_workers(), stale_after=stale_after)
    return bool(reason) and abandon(job, reason)


def sweep_own_jobs(hostname: str, started_before: datetime) -> list[int]:
    """On worker start: every job this hostname was running before it started is lost."""
    lost = []
    jobs = Job.objects.select_related("node").filter(
        state=JobState.RUNNING, worker=hostname, started_at__lt=started_before
    )
    for job in jobs:
        if abandon(job, f"Worker lost: {hostname} restarted while the job was running."):
            lost.append(job.pk)
    return lost


def sweep_dead_runner(job_id: int, hostname: str) -> bool:
    """A task for a job that is already running was delivered again to `hostname` (Celery redelivers when
    a worker's child process dies). When the run it finds belongs to this host and its process is gone,
    the job is lost now rather than after the heartbeat goes stale. True when it was declared lost."""
    job = Job.objects.select_related("node").filter(pk=job_id, state=JobState.RUNNING).first()
    if job is None or job.worker != hostname or not runner_died_here(job):
        return False
    return abandon(job, f"Worker lost: the process running it on {hostname} (PID {job.runner_pid}) died.")


def runner_died_here(job: Job) -> bool:
    """The job's runner process was on this host (same host name) and is gone (or its PID is now a
    process younger than the job)."""
    if not job.runner_pid or not job.worker:
        return False
    host = job.worker.rsplit("@", 1)[-1].split(":", 1)[0]
    if host != socket.gethostname():
        return False
    try:
        process = psutil.Process(job.runner_pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return True
        started = job.started_at or job.created_at
        return process.create_time() > started.timestamp() + 1
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:
        return False


def abandon(job: Job, reason: str) -> bool:
    """Mark a running (or queued) job errored with `reason`, its steps with it, then deal with its remote
    process and tell the app that owns its kind. True if it was ours to mark (a racing runner or sweeper
    may have finished it first)."""
    if not job.finish(JobState.ERRORED, result=reason):
        return False
    logger.warning("Job %s: %s", job.pk, reason)
    for child in Job.objects.select_related("node").filter(parent_id=job.pk, state=JobState.RUNNING):
        abandon(child, f"Worker lost: the job it is a step of ({job.pk}) was lost.")
    job.skip_queued_children(f"Skipped: {reason}")
    notes = [reason]
    if job.remote_pid:
        notes += _deal_with_remote_process(job)
    rows = job.append_lines([(LogStream.SYSTEM, note) for note in notes])
    broadcast.send_lines_sync(job.pk, rows, job.notify_groups)
    broadcast.send_status_sync(job.pk, job.state, job.notify_groups)
    kind = kinds.get(job.kind)
    if kind is not None:
        try:
            kind.ended(job)
        except Exception:
            logger.exception("Job %s: the %s kind's on_end hook failed.", job.pk, job.kind)
    return True


def wants_adoption(job: Job) -> bool:
    kind = kinds.get(job.kind)
    return bool(job.params.get("adopt_on_loss", kind.adopt_on_loss if kind else False))


# -- queued jobs whose message was lost ---------------------------------------------------------------------


def sweep_queued(
    *, resend_after: float | None = None, give_up_after: float | None = None, now: datetime | None = None
) -> tuple[list[int], list[int]]:
    """Send again the queued jobs whose message is in no queue; error those queued too long. Returns
    (sent again, errored). Steps are left to their parent job."""
    resend_after = settings.RAMDECK_QUEUED_RESEND_AFTER_S if resend_after is None else resend_after
    give_up_after = settings.RAMDECK_QUEUED_GIVE_UP_S if give_up_after is None else give_up_after
    now = now or timezone.now()
    cutoff = now - timedelta(seconds=resend_after)
    suspects = list(
        Job.objects.select_related("node").filter(
            Q(enqueued_at__lt=cutoff) | Q(enqueued_at__isnull=True, created_at__lt=cutoff),
            state=JobState.QUEUED,
            parent__isnull=True,
        )
    )
    if not suspects:
        return [], []
    waiting = job_ids_in_broker()
    resent, errored = [], []
    for job in suspects:
        age = (now - job.created_at).total_seconds()
        if age > give_up_after:
            reason = f"Never started: no worker took it in {age / 60:.0f} minutes (its message was lost?)."
            if abandon(job, reason):
                errored.append(job.pk)
            continue
        if waiting is not None and job.pk in waiting:
            continue  # Its message waits behind other work: nothing was lost.
        logger.warning(
            "Job %s has been queued for %.0f s with no message in the broker: sending again.", job.pk, age
        )
        if job.send_to_worker():
            resent.append(job.pk)
    return resent, errored


def job_ids_in_broker() -> set[int] | None:
    """Ids of the jobs whose run task waits in a queue of the Redis broker or is held unacknowledged by a
    worker; None when the broker cannot be read that way (then every suspect is sent again: a duplicate
    message is harmless, the runner's claim makes it a no-op)."""

    queues = {app.conf.task_default_queue, settings.RAMDECK_CONTROL_QUEUE}
    try:
        with app.connection_for_read() as connection:
            client = connection.default_channel.client
            payloads = [item for queue in queues for item in client.lrange(queue, 0, -1)]
            payloads += list(client.hvals("unacked"))
    except Exception as exc:
        logger.warning("Could not read the broker's queues: %s", exc)
        return None
    found = set()
    for payload in payloads:
        with_headers = _message_headers(payload)
        if with_headers.get("task") == RUN_TASK:
            try:
                found.add(int(str(with_headers.get("argsrepr", "")).strip("[](),")))
            except ValueError:
                continue
    return found


def _message_headers(payload: bytes | str) -> dict:
    """The headers of a kombu message as the Redis transport stores it (a JSON envelope; unacknowledged
    ones are [envelope, exchange, routing key])."""
    try:
        data = json.loads(payload)
    except (TypeError, ValueError):
        return {}
    if isinstance(data, list) and data:
        data = data[0]
    return data.get("headers") or {} if isinstance(data, dict) else {}


def _deal_with_remote_process(job: Job) -> list[str]:
    pid = job.remote_pid
    where = job.node_name or "the console's host"
    try:
        end = not wants_adoption(job)
        alive, ended = run_to_completion(lambda: with_own_db_thread(_check_and_end(job, pid, end=end)))
    except TransportError as exc:
        return [f"Could not reach {where} to end process {pid}: {exc}"]
    except Exception as exc:
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
