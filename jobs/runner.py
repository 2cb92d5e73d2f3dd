"""The one job runner. `run_job(job_id)` is the single entry; Celery's task calls it (jobs/tasks.py).

One event loop per job (`asyncio.run`), never one per message. Inside it:

- the job is claimed with a conditional `queued → running` update, so a redelivered task does nothing;
- the node's transport is opened and the body for `job.kind` (jobs/bodies.py) runs with a `JobContext`;
- output lines are buffered briefly, saved in bulk with gap-free `seq` numbers FIRST, then sent to the
  channel group `job-<pk>` (jobs/broadcast.py), so a watcher can always catch up from the database;
- a watcher task beats the heartbeat (for the sweeper of lost jobs) and polls `cancel_requested`; on a
  cancel it ends the running remote process by its PID through the transport (TERM, then KILL);
- the outcome maps to a state: `JobFailed` → failed, `TransportError` → errored, cancel → cancelled,
  anything else → errored with its traceback in the job log.

The ORM is synchronous, so every database call goes through `sync_to_async` (one thread, in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import traceback
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.db import DatabaseError, connections
from django.utils.module_loading import import_string

from . import broadcast
from . import transport as transport_module
from .bodies import BODIES
from .models import Job, JobState, LogStream
from .transport import CommandResult, CommandTimeout, OutputLine, TransportError, shell_join

logger = logging.getLogger(__name__)

# Output is saved in batches: at most this long after a line arrived, or as soon as this many wait.
FLUSH_DELAY_S = 0.05
FLUSH_LINES = 500
# One insert and one group message never carry more than this (a fast producer overfills the buffer
# between two wake-ups); the rest goes in the next batch at once.
MAX_BATCH_LINES = 2000
# A reader this far ahead of the database waits, so a flood of output cannot exhaust memory.
MAX_PENDING_LINES = 20_000
# A single line longer than this (a binary blob, a minified file) is cut; the rest is not worth a page.
MAX_LINE_CHARS = 32_768
WATCH_INTERVAL_S = 0.5
HEARTBEAT_INTERVAL_S = 5.0


class JobFailed(Exception):
    """The work ran and did not succeed. `reason` is the job's one-line result."""

    def __init__(self, reason: str, *, exit_code: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


class JobCancelled(Exception):
    """Raised inside a body when an operator cancelled the job."""


def db(func: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """Run a synchronous ORM call off the event loop, in the one database thread."""
    return sync_to_async(func, thread_sensitive=True)


def default_worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def clean_text(text: str) -> str:
    """A line the database accepts: no NUL (PostgreSQL refuses it), valid UTF-8, bounded length."""
    if "\x00" in text:
        text = text.replace("\x00", "")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            text = text.encode("utf-8", "replace").decode("utf-8")
    if len(text) > MAX_LINE_CHARS:
        text = text[:MAX_LINE_CHARS] + f" … [{len(text) - MAX_LINE_CHARS} more characters cut]"
    return text


class LogWriter:
    """Buffers lines and saves them in batches (then sends them) from one background task, in order."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._pending: list[tuple[str, str]] = []
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._room.set()
        self._closing = False
        self._error: BaseException | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=f"job-{self.job.pk}-log")

    async def write(self, stream: str, text: str) -> None:
        if self._error is not None:
            raise self._error
        self._pending.append((stream, clean_text(text)))
        if len(self._pending) >= FLUSH_LINES:
            self._wake.set()
        if len(self._pending) >= MAX_PENDING_LINES:
            self._room.clear()
            await self._room.wait()

    async def close(self) -> None:
        """Save everything still buffered; raise if saving failed."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
        if self._error is not None:
            raise self._error

    async def _loop(self) -> None:
        try:
            while True:
                if not self._closing:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), FLUSH_DELAY_S)
                self._wake.clear()
                while self._pending:
                    batch = self._pending[:MAX_BATCH_LINES]
                    del self._pending[:MAX_BATCH_LINES]
                    await self._flush(batch)
                    if len(self._pending) < MAX_PENDING_LINES:
                        self._room.set()
                self._room.set()
                if self._closing:
                    return
        except BaseException as exc:
            self._error = exc
            self._room.set()

    async def _flush(self, batch: list[tuple[str, str]]) -> None:
        for attempt in range(3):
            try:
                rows = await db(self.job.append_lines)(batch)
                break
            except DatabaseError:
                # The insert is atomic, so a retry never duplicates; a busy SQLite file usually clears.
                if attempt == 2:
                    raise
                await asyncio.sleep(0.5 * (attempt + 1))
        await broadcast.send_lines(self.job.pk, rows)


class JobContext:
    """What a body gets: the job, its node, the open transport, and helpers that log as they go."""

    def __init__(self, job: Job, writer: LogWriter) -> None:
        self.job = job
        self.node = job.node
        self.transport = None  # Set once the transport is open.
        self.last_exit_status: int | None = None
        self._writer = writer
        self._cancel = asyncio.Event()
        self._recorded_pid: int | None = None
        self._daemon_pid: int | None = None

    async def log(self, text: str, stream: str = LogStream.SYSTEM) -> None:
        for line in str(text).splitlines() or [""]:
            await self._writer.write(stream, line)

    def cancelled(self) -> bool:
        return self._cancel.is_set()

    async def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float | None = None,
        check: bool = True,
        env: dict[str, str] | None = None,
        capture: bool = True,
        echo: bool = True,
    ) -> CommandResult:
        """Run argv on the node, every output line into the job log. `capture` keeps the lines in the
        result too (for parsing); `check` raises JobFailed on a non-zero exit."""
        if self.cancelled():
            raise JobCancelled()
        argv = [str(arg) for arg in argv]
        if echo:
            await self.log("$ " + shell_join(argv))
        captured: list[OutputLine] = []
        transport = self.transport
        try:
            async for line in transport.stream(argv, timeout=timeout, env=env):
                if (pid := getattr(transport, "current_pid", None)) and pid != self._recorded_pid:
                    await self._note_pid(pid)
                await self._writer.write(line.stream, line.text)
                if capture:
                    captured.append(line)
            status = transport.last_result or CommandResult(exit_status=None)
        finally:
            await self._note_pid(None)
        if self.cancelled():
            raise JobCancelled()
        self.last_exit_status = status.exit_status
        result = CommandResult(exit_status=status.exit_status, signal=status.signal, lines=captured)
        if check and not result.ok:
            how = (
                f"was ended by signal {result.signal}"
                if result.signal
                else f"exited with status {result.exit_status}"
            )
            raise JobFailed(f"{argv[0]} {how}.", exit_code=result.exit_status)
        return result

    async def start_daemon(self, argv: Sequence[str], *, log_path: str, cwd: str | None = None) -> int:
        """Start a detached process on the node and record its PID on the job."""
        if self.cancelled():
            raise JobCancelled()
        argv = [str(arg) for arg in argv]
        await self.log(f"$ {shell_join(argv)} > {log_path} &")
        pid = await self.transport.start_daemon(argv, log_path=log_path, cwd=cwd)
        self._daemon_pid = pid
        await self._note_pid(None)
        await self.log(f"Started {argv[0]} as PID {pid}; its output goes to {log_path}.")
        return pid

    async def _note_pid(self, pid: int | None) -> None:
        """Keep `job.remote_pid` on the process to end if this job is cancelled or lost: the command
        running now, else the last daemon started."""
        pid = pid or self._daemon_pid
        if pid != self._recorded_pid:
            self._recorded_pid = pid
            await db(self.job.record_remote_pid)(pid)

    async def _cancel_now(self, main_task: asyncio.Task) -> None:
        self._cancel.set()
        await self.log("Cancel requested by an operator.")
        pid = getattr(self.transport, "current_pid", None)
        grace = settings.RAMDECK_KILL_GRACE_S
        if pid:
            await self.log(f"Ending process {pid} (TERM, then KILL after {grace:g} s).")
            try:
                await self.transport.kill(pid, grace=grace)
            except TransportError as exc:
                await self.log(f"Could not end process {pid}: {exc}")
            # The body sees the stream end and raises JobCancelled; if it is stuck elsewhere, interrupt it.
            asyncio.get_running_loop().call_later(grace + 5, _cancel_task, main_task)
        else:
            main_task.cancel()


def _cancel_task(task: asyncio.Task) -> None:
    if not task.done():
        task.cancel()


def _cancel_requested(job_id: int) -> bool:
    return Job.objects.filter(pk=job_id).values_list("cancel_requested", flat=True).first() or False


async def _watch(ctx: JobContext, main_task: asyncio.Task) -> None:
    """Heartbeat, PID bookkeeping for silent commands, and cancel polling, until the body ends."""
    loop = asyncio.get_running_loop()
    last_beat = loop.time()
    while not main_task.done():
        await asyncio.sleep(WATCH_INTERVAL_S)
        try:
            await ctx._note_pid(getattr(ctx.transport, "current_pid", None))
            requested = await db(_cancel_requested)(ctx.job.pk)
            if loop.time() - last_beat >= HEARTBEAT_INTERVAL_S:
                await db(ctx.job.touch)()
                last_beat = loop.time()
        except DatabaseError as exc:
            logger.warning("Job %s: database busy in the watcher (%s); trying again.", ctx.job.pk, exc)
            continue
        if requested and not ctx.cancelled():
            await ctx._cancel_now(main_task)


async def open_transport_for(node):
    """The transport for a node: the factory in jobs/transport.py, else the local transport."""
    factory = getattr(transport_module, "open_transport", None)
    if factory is not None and node is not None:
        # The factory reads the node's credential from the database: call it in the database thread.
        opened = await db(factory)(node)
        return await opened if asyncio.iscoroutine(opened) else opened
    if node is None or node.is_local:
        from .local import LocalTransport

        return LocalTransport()
    raise TransportError(f"No transport can reach {node.name} ({node.get_transport_display()}).")


async def with_own_db_thread(awaitable: Awaitable[Any]) -> Any:
    """Await with a database thread of this run's own (for `db` and for bodies' own sync_to_async
    calls), ended and its connection closed afterwards. Without the context, asgiref would use one
    process-wide thread that outlives the run: its connection would linger, and a process forked
    later (a test's live server) would inherit a thread pool whose thread does not exist."""
    async with ThreadSensitiveContext():
        try:
            return await awaitable
        finally:
            # Celery closes the main thread's connection after each task; this thread's is ours.
            await db(connections.close_all)()


def body_for(kind: str) -> Callable[[JobContext], Awaitable[str]]:
    try:
        return import_string(BODIES[kind])
    except KeyError:
        raise TransportError(f"This console does not know how to run a {kind!r} job.") from None


async def _main(ctx: JobContext) -> str:
    body = body_for(ctx.job.kind)
    async with await open_transport_for(ctx.node) as transport:
        ctx.transport = transport
        return await body(ctx)


def _outcome_of_exception(exc: BaseException, ctx: JobContext) -> tuple[str, int | None, str, list[str]]:
    """(state, exit code, result, extra log lines) for how the body ended."""
    if isinstance(exc, JobCancelled | asyncio.CancelledError) and ctx.cancelled():
        return JobState.CANCELLED, ctx.last_exit_status, "Cancelled by an operator.", []
    if isinstance(exc, JobFailed):
        return JobState.FAILED, exc.exit_code, exc.reason, []
    if isinstance(exc, CommandTimeout):
        # The command ran, but longer than allowed: the work failed, the node was reachable.
        return JobState.FAILED, None, str(exc), []
    if isinstance(exc, TransportError):
        return JobState.ERRORED, None, str(exc), []
    lines = "".join(traceback.format_exception(exc)).splitlines()
    return JobState.ERRORED, None, f"Internal error: {type(exc).__name__}: {exc}", lines


async def _execute(job: Job) -> None:
    writer = LogWriter(job)
    writer.start()
    ctx = JobContext(job, writer)
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
        await broadcast.send_status(job.pk, job.state)
    else:
        logger.warning("Job %s was already finished elsewhere (lost-job sweeper?); kept that state.", job.pk)


def run_job(job_id: int, *, worker: str = "") -> None:
    """Claim and run one job to its end. A job that is not queued (already run, or running under a
    redelivered task) is left alone."""
    if _event_loop_running():
        # asyncio.run cannot start inside a running loop (a caller on Playwright's test thread, say):
        # run on a thread of our own, with its own database connection, closed afterwards.
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(_run_job_and_close, job_id, worker).result()
        return
    job = Job.objects.select_related("node", "node__credential").filter(pk=job_id).first()
    if job is None:
        logger.warning("Job %s does not exist; nothing to run.", job_id)
        return
    if not job.mark_running(worker=worker or default_worker_name()):
        logger.info("Job %s is %s, not queued: this delivery does nothing.", job_id, job.state)
        return
    broadcast.send_status_sync(job.pk, job.state)
    asyncio.run(with_own_db_thread(_execute(job)))


def run_to_completion(make: Callable[[], Awaitable[Any]]) -> Any:
    """`asyncio.run(make())` for synchronous callers; on a short-lived thread when this thread's own
    event loop is already running (asyncio.run refuses to nest)."""
    if not _event_loop_running():
        return asyncio.run(make())
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()


def _event_loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _run_job_and_close(job_id: int, worker: str) -> None:
    try:
        run_job(job_id, worker=worker)
    finally:
        connections.close_all()


def enqueue(job: Job) -> None:
    """Send the job to a worker once the transaction that created it commits."""
    from django.db import transaction

    from . import tasks

    transaction.on_commit(lambda: tasks.run_job.delay(job.pk))
