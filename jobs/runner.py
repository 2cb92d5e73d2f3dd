"""The one job runner. `run_job(job_id)` is the single entry; Celery's task calls it (jobs/tasks.py).

One event loop per job (`asyncio.run`), never one per message. Inside it:

- the job is claimed with a conditional `queued → running` update, so a redelivered task does nothing;
- the node's transport is opened and the body of the job's kind (jobs/kinds.py) runs with a `JobContext`
  (jobs/context.py); a body that runs steps calls `ctx.run_child(job)`, and each step is claimed, watched
  and finished here exactly like a job of its own;
- output lines go through a `LogWriter` (jobs/logwriter.py): saved first, then sent;
- a watcher task per job beats the heartbeat (for the sweeper of lost jobs), polls `cancel_requested` and
  enforces the kind's time limit; on a cancel it ends the running remote process by its PID through the
  transport (TERM, then KILL), or asks the running step to cancel;
- the outcome maps to a state: `JobFailed` → failed, an SSH host key no admin approved →
  needs_approval, any other `TransportError` → errored, cancel → cancelled, time limit → errored,
  anything else → errored with its traceback in the job log.

The ORM is synchronous, so every database call goes through `db` (one thread, in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import traceback
from concurrent.futures import ThreadPoolExecutor

from django.db import DatabaseError, connections

from jobs import broadcast, kinds
from jobs.aio import db, event_loop_running, open_transport_for, with_own_db_thread
from jobs.context import JobCancelled, JobContext, JobFailed
from jobs.logwriter import LogWriter
from jobs.models import Job, JobState, LogStream
from remote.base import CommandTimeout, HostKeyChanged, HostKeyUnknown, TransportError
from remote.powershell import NotForWindows

logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5
HEARTBEAT_INTERVAL_S = 5.0


def default_worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _cancel_requested(job_id: int) -> bool:
    return Job.objects.filter(pk=job_id).values_list("cancel_requested", flat=True).first() or False


def time_limit_of(job: Job) -> float:
    return kinds.time_limit_for(job.kind)


async def _watch(ctx: JobContext, main_task: asyncio.Task) -> None:
    """Heartbeat, PID bookkeeping for silent commands, cancel polling and the time limit, until the body
    ends."""
    loop = asyncio.get_running_loop()
    last_beat = loop.time()
    deadline = loop.time() + time_limit_of(ctx.job)
    while not main_task.done():
        await asyncio.sleep(WATCH_INTERVAL_S)
        try:
            await ctx._note_pid(ctx.current_pid)
            requested = await db(_cancel_requested)(ctx.job.pk)
            if loop.time() - last_beat >= HEARTBEAT_INTERVAL_S:
                await db(ctx.job.touch)()
                last_beat = loop.time()
        except DatabaseError as exc:
            logger.warning("Job %s: database busy in the watcher (%s); trying again.", ctx.job.pk, exc)
            continue
        if ctx.cancelled():
            continue
        if requested:
            await ctx.stop(main_task, "Cancel requested by an operator.")
        elif loop.time() >= deadline:
            limit = time_limit_of(ctx.job)
            await ctx.stop(
                main_task,
                f"The job ran past its time limit ({limit:g} s) and was stopped.",
                past_time_limit=True,
            )


async def _main(ctx: JobContext) -> str:
    kind = kinds.get(ctx.job.kind)
    if kind is None:
        raise TransportError(f"This console does not know how to run a {ctx.job.kind!r} job.")
    body = kind.resolve_body()
    if not kind.needs_transport:
        return await body(ctx)
    async with await open_transport_for(ctx.node) as transport:
        ctx.transport = transport
        return await body(ctx)


def _outcome_of_exception(exc: BaseException, ctx: JobContext) -> tuple[str, int | None, str, list[str]]:
    """(state, exit code, result, extra log lines) for how the body ended."""
    if isinstance(exc, JobCancelled | asyncio.CancelledError) and ctx.cancelled():
        if ctx.past_time_limit:
            return JobState.ERRORED, ctx.last_exit_status, ctx.stop_reason, []
        return JobState.CANCELLED, ctx.last_exit_status, "Cancelled by an operator.", []
    if isinstance(exc, JobCancelled):
        # The body itself found that its work is no longer wanted (say, the deployment is being stopped).
        return JobState.CANCELLED, ctx.last_exit_status, str(exc) or "Cancelled.", []
    if isinstance(exc, JobFailed):
        return JobState.FAILED, exc.exit_code, exc.reason, []
    if isinstance(exc, CommandTimeout):
        # The command ran, but longer than allowed: the work failed, the node was reachable.
        return JobState.FAILED, None, str(exc), []
    if isinstance(exc, HostKeyUnknown | HostKeyChanged):
        # Not an error: the console did what it must (refuse an unapproved key); an admin decides next.
        return JobState.NEEDS_APPROVAL, None, str(exc), []
    if isinstance(exc, TransportError):
        return JobState.ERRORED, None, str(exc), []
    if isinstance(exc, NotForWindows):
        # A step that only has a POSIX command met a Windows node: a readable failure, not a traceback.
        return JobState.FAILED, None, f"This does not run on a Windows node yet: {exc}", []
    lines = "".join(traceback.format_exception(exc)).splitlines()
    return JobState.ERRORED, None, f"Internal error: {type(exc).__name__}: {exc}", lines


async def _execute(job: Job) -> None:
    """Run a claimed job's body to its end under a watcher, and record how it ended."""
    writer = LogWriter(job)
    writer.start()
    ctx = JobContext(job, writer, run_child=_run_child)
    main_task = asyncio.create_task(_main(ctx), name=f"job-{job.pk}-body")
    watcher = asyncio.create_task(_watch(ctx, main_task), name=f"job-{job.pk}-watch")
    try:
        result = await main_task
        state, exit_code, extra = JobState.SUCCEEDED, ctx.last_exit_status, []
        result = str(result or "Done.")
    except BaseException as exc:
        current = asyncio.current_task()
        if isinstance(exc, asyncio.CancelledError) and current is not None and current.cancelling():
            raise  # The runner itself is being stopped, not the body.
        if not isinstance(exc, Exception | asyncio.CancelledError):
            raise
        state, exit_code, result, extra = _outcome_of_exception(exc, ctx)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher
    await _finish(job, writer, state, exit_code, result, extra)


async def _finish(job: Job, writer: LogWriter, state: str, exit_code, result: str, extra: list[str]) -> None:
    try:
        for line in extra:
            await writer.write(LogStream.SYSTEM, line)
        await writer.write(LogStream.SYSTEM, f"{JobState(state).label}: {result}")
        await writer.close()
    except Exception:
        logger.exception("Job %s: could not save the last log lines.", job.pk)
    if await db(job.finish)(state, exit_code=exit_code, result=result):
        await broadcast.send_status(job.pk, job.state, job.notify_groups)
    else:
        logger.warning("Job %s was already finished elsewhere (lost-job sweeper?); kept that state.", job.pk)
    # Steps the body never reached never will run.
    await db(job.skip_queued_children)(f"Skipped: {job} ended ({JobState(job.state).label.lower()}).")
    kind = kinds.get(job.kind)
    if kind is not None and kind.on_end is not None:
        try:
            await db(kind.ended)(job)
        except Exception:
            logger.exception("Job %s: the %s kind's on_end hook failed.", job.pk, job.kind)


async def _run_child(parent: JobContext, child: Job) -> Job:
    """`ctx.run_child`: claim the step under the parent's worker, run it like any job, return it ended."""
    child = await db(_load)(child.pk)
    claimed = await db(child.mark_running)(parent.job.worker, parent.job.runner_pid)
    if not claimed:
        await db(child.refresh_from_db)()
        await parent.log(f"Step {child.title or child} is {child.state}, not queued: not run again.")
        return child
    await broadcast.send_status(child.pk, child.state, child.notify_groups)
    await parent.log(f"Step: {child.title or child} (job {child.pk})")
    await _execute(child)
    await db(child.refresh_from_db)()
    await parent.log(f"Step {child.get_state_display().lower()}: {child.result}")
    return child


def _load(job_id: int) -> Job:
    return Job.objects.select_related("node").get(pk=job_id)


def run_job(job_id: int, *, worker: str = "") -> bool:
    """Claim and run one job to its end; False when there was nothing to run (the job is not queued:
    already run, or running under another delivery, or a step that its parent runs)."""
    if event_loop_running():
        # asyncio.run cannot start inside a running loop (a caller on Playwright's test thread, say):
        # run on a thread of our own, with its own database connection, closed afterwards.
        with ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(_run_job_and_close, job_id, worker).result()
    job = Job.objects.select_related("node").filter(pk=job_id).first()
    if job is None:
        logger.warning("Job %s does not exist; nothing to run.", job_id)
        return False
    if not job.mark_running(worker=worker or default_worker_name(), runner_pid=os.getpid()):
        logger.info("Job %s is %s, not queued: this delivery does nothing.", job_id, job.state)
        return False
    broadcast.send_status_sync(job.pk, job.state, job.notify_groups)
    asyncio.run(with_own_db_thread(_execute(job)))
    return True


def _run_job_and_close(job_id: int, worker: str) -> bool:
    try:
        return run_job(job_id, worker=worker)
    finally:
        connections.close_all()
