"""The kinds of job, each registered by the app that owns it in its `AppConfig.ready()`.

A kind names its body (`async def body(ctx: JobContext) -> str`, see jobs/context.py), the Celery queue its
jobs go to, and what becomes of a job whose worker is lost: its recorded process is ended, or adopted
when it is a daemon meant to outlive the job. `on_end` lets the owning app react whenever a job of the
kind ends, lost ones included (a deployment run that was lost rolls back and fails the deployment). This
module imports nothing of the apps above it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.utils.module_loading import import_string

if TYPE_CHECKING:
    from jobs.context import JobContext
    from jobs.models import Job

Body = Callable[["JobContext"], Awaitable[str]]

# Queues. `work` is Celery's default queue: builds, downloads, deployments, commands. `control` is short
# work that must never wait behind them: stopping, reaping, probing (and the periodic checks).
WORK = "work"
CONTROL = "control"


@dataclass(frozen=True)
class Kind:
    name: str
    label: str
    body: str | Body
    queue: str = WORK
    # The job's process is a daemon meant to outlive it (ggml-rpc-server, llama-server): when the job is
    # lost, the process is left running (adopted) instead of ended. A job's params["adopt_on_loss"] wins.
    adopt_on_loss: bool = False
    # Called (dotted path or function, with the Job, in synchronous code) after a job of this kind ended,
    # by its runner or, when it was lost, by the sweeper.
    on_end: str | Callable[[Job], Any] | None = None
    # Whether the body acts on the node itself; a parent that only runs children opens no connection.
    needs_transport: bool = True
    # Seconds a job of this kind may run; None: RAMDECK_JOB_TIME_LIMIT_S.
    time_limit: float | None = None

    def resolve_body(self) -> Body:
        return import_string(self.body) if isinstance(self.body, str) else self.body

    def ended(self, job: Job) -> None:
        if self.on_end is not None:
            hook = import_string(self.on_end) if isinstance(self.on_end, str) else self.on_end
            hook(job)


_KINDS: dict[str, Kind] = {}


def register(name: str, label: str, body: str | Body, **options: Any) -> Kind:
    """Add a kind (again with the same name replaces it: test modules register their own bodies)."""
    if len(name) > 20:
        raise ValueError(f"Job kind names have at most 20 characters: {name!r}")
    kind = Kind(name, label, body, **options)
    _KINDS[name] = kind
    return kind


def unregister(name: str) -> None:
    _KINDS.pop(name, None)


def get(name: str) -> Kind | None:
    return _KINDS.get(name)


def names() -> list[str]:
    return list(_KINDS)


def choices() -> list[tuple[str, str]]:
    """For the Job.kind field and the job list's filter (a callable, so a new kind needs no migration)."""
    return [(kind.name, kind.label) for kind in _KINDS.values()]


def time_limit_for(name: str) -> float:
    """Seconds a job of this kind may run before the runner stops it: the kind's own limit, else
    RAMDECK_JOB_TIME_LIMIT_S."""
    kind = _KINDS.get(name)
    return float((kind.time_limit if kind else None) or settings.RAMDECK_JOB_TIME_LIMIT_S)


def queue_for(name: str) -> str | None:
    """The Celery queue of a kind's jobs: None for Celery's default queue, else the control queue."""
    kind = _KINDS.get(name)
    return settings.RAMDECK_CONTROL_QUEUE if kind is not None and kind.queue == CONTROL else None
