"""What a job body works with: `JobContext`, and the two ways a body ends other than returning.

A body is `async def body(ctx: JobContext) -> str` (registered with its kind, jobs/kinds.py). It acts on the
node through `ctx.run`, `ctx.start_daemon` and `ctx.transport`, writes progress with `ctx.log`, runs its
steps with `await ctx.run_child(job)`, raises `JobFailed(reason)` when the work ran but did not succeed,
and returns one line for the job's result. The runner (jobs/runner.py) builds the context and supervises
the run: heartbeat, cancel, time limit and the final state are its business, not the body's.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

from django.conf import settings

from jobs.aio import db
from jobs.models import Job, LogStream
from remote.base import Command, CommandResult, OutputBudget, OutputLine, TransportError, shell_join
from remote.powershell import decode_script, is_powershell_argv, start_detached_script

if TYPE_CHECKING:
    from jobs.logwriter import LogWriter


class JobFailed(Exception):
    """The work ran and did not succeed. `reason` is the job's one-line result."""

    def __init__(self, reason: str, *, exit_code: int | None = None):
        super().__init__(reason)
        self.reason = reason
        self.exit_code = exit_code


class JobCancelled(Exception):
    """Raised inside a body when an operator cancelled the job (or it ran past its time limit)."""


ChildRunner = Callable[["JobContext", Job], Awaitable[Job]]


class JobContext:
    """What a body gets: the job, its node, the open transport, and helpers that log as they go."""

    def __init__(self, job: Job, writer: LogWriter, *, run_child: ChildRunner | None = None) -> None:
        self.job = job
        self.node = job.node
        self.transport = None  # Set by the runner once the transport is open.
        self.last_exit_status: int | None = None
        # Why the run is being stopped, for people ("" while it is not), and whether the time limit stopped it
        # (then the job errored: nobody asked for the stop).
        self.stop_reason = ""
        self.past_time_limit = False
        self._writer = writer
        self._run_child = run_child
        self._cancel = asyncio.Event()
        self._command: Command | None = None
        self._recorded_pid: int | None = None
        self._daemon_pid: int | None = None
        self.child: Job | None = None  # The step running now, if any.

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
        input: bytes | None = None,
    ) -> CommandResult:
        """Run argv on the node, every output line into the job log. `capture` keeps the lines in the
        result too (for parsing); `check` raises JobFailed on a non-zero exit; `input` goes to the command's
        standard input (never to the log)."""
        if self.cancelled():
            raise JobCancelled()
        argv = [str(arg) for arg in argv]
        if echo:
            # A Windows command travels base64-encoded (remote/powershell.py); people read its script.
            await self.log(
                f"PS> {decode_script(argv)}" if is_powershell_argv(argv) else "$ " + shell_join(argv)
            )
        captured: list[OutputLine] = []
        tail: deque[str] = deque(maxlen=TAIL_LINES)
        # Past the budget, lines are neither logged nor kept; the last of them are, after a note, since how
        # a command ended is what a person reads first.
        budget = OutputBudget(settings.RAMDECK_COMMAND_OUTPUT_MAX_BYTES)
        unkept: deque[OutputLine] = deque(maxlen=TAIL_LINES)
        command = self.transport.command(argv, timeout=timeout, env=env, input=input)
        self._command = command
        try:
            async for line in command.lines():
                if command.pid and command.pid != self._recorded_pid:
                    await self._note_pid(command.pid)
                tail.append(line.text)
                if not budget.keep(line):
                    unkept.append(line)
                    continue
                await self._writer.write(line.stream, line.text)
                if capture:
                    captured.append(line)
            status = command.result
        finally:
            self._command = None
            await self._note_pid(None)
            if budget.truncated:
                note = budget.note()
                await self.log(note + (f"; its last {len(unkept)} lines:" if unkept else ""))
                for line in unkept:
                    await self._writer.write(line.stream, line.text)
                if capture:
                    captured.append(OutputLine("err", note))
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
            raise JobFailed(f"{argv[0]} {how}{disk_full_hint(tail)}.", exit_code=result.exit_status)
        return result

    async def start_daemon(self, argv: Sequence[str], *, log_path: str, cwd: str | None = None) -> int:
        """Start a detached process on the node and record its PID on the job."""
        if self.cancelled():
            raise JobCancelled()
        argv = [str(arg) for arg in argv]
        if getattr(self.transport, "shell", "posix") == "windows":
            await self.log(f"PS> {start_detached_script(argv, log_path=log_path, cwd=cwd)}")
        else:
            await self.log(f"$ {shell_join(argv)} > {log_path} &")
        pid = await self.transport.start_daemon(argv, log_path=log_path, cwd=cwd)
        self._daemon_pid = pid
        await self._note_pid(None)
        # `env VAR=value program ...` execs the program in place: the PID is the program's.
        program = next((a for a in argv[1:] if "=" not in a), argv[0]) if argv[0] == "env" else argv[0]
        await self.log(f"Started {program} as PID {pid}; its output goes to {log_path}.")
        return pid

    async def run_child(self, child: Job) -> Job:
        """Run one step of this job to its end, supervised like any job, and return it finished (in any
        state: the caller decides what a failed step means). Raises JobCancelled when this job is being
        stopped, before or during the step."""
        if self._run_child is None:
            raise TypeError("This context cannot run child jobs.")
        if self.cancelled():
            raise JobCancelled()
        self.child = child
        try:
            finished = await self._run_child(self, child)
        finally:
            self.child = None
        if self.cancelled():
            raise JobCancelled()
        return finished

    @property
    def current_pid(self) -> int | None:
        """The PID of the command running now, if the transport knows it yet."""
        return self._command.pid if self._command is not None else None

    async def _note_pid(self, pid: int | None) -> None:
        """Keep `job.remote_pid` on the process to end if this job is cancelled or lost: the command
        running now, else the last daemon started."""
        pid = pid or self._daemon_pid
        if pid != self._recorded_pid:
            self._recorded_pid = pid
            await db(self.job.record_remote_pid)(pid)

    async def stop(self, main_task: asyncio.Task, reason: str, *, past_time_limit: bool = False) -> None:
        """End the run: the command running now by its PID (TERM, then KILL), a running step through its
        own cancel, and the body itself if it does not end on its own."""
        self._cancel.set()
        self.stop_reason = reason
        self.past_time_limit = past_time_limit
        await self.log(reason)
        grace = settings.RAMDECK_KILL_GRACE_S
        loop = asyncio.get_running_loop()
        if self.child is not None:
            # The step's own watcher sees the request and ends its process; this body then sees the step
            # end and raises JobCancelled.
            await db(_request_child_cancel)(self.child.pk)
            loop.call_later(grace + 15, _cancel_task, main_task)
            return
        pid = self.current_pid
        if pid:
            await self.log(f"Ending process {pid} (TERM, then KILL after {grace:g} s).")
            try:
                await self.transport.kill(pid, grace=grace)
            except TransportError as exc:
                await self.log(f"Could not end process {pid}: {exc}")
            # The body sees the stream end and raises JobCancelled; if it is stuck elsewhere, interrupt it.
            loop.call_later(grace + 5, _cancel_task, main_task)
        else:
            main_task.cancel()


# Lines of a command's output kept to explain its failure.
TAIL_LINES = 20
_DISK_FULL = ("No space left on device", "Disk quota exceeded")


def disk_full_hint(lines) -> str:
    """ ": the disk is full (...)" when a failed command's last lines say so, else "": a person should read
    that first, not dig for it in a long log."""
    for text in reversed(lines):
        if any(marker in text for marker in _DISK_FULL):
            return f": the node's disk is full ({text.strip()[:200]})"
    return ""


def _request_child_cancel(child_id: int) -> None:
    child = Job.objects.filter(pk=child_id).first()
    if child is not None:
        child.request_cancel()


def _cancel_task(task: asyncio.Task) -> None:
    if not task.done():
        task.cancel()
