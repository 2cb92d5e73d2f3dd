"""Jobs (everything that changes a node) and their log lines."""

from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import PermissionDenied
from django.db import connections, models, router, transaction
from django.db.models import F
from django.urls import reverse
from django.utils import timezone

from audit import history
from jobs import kinds
from ramdeck_site.celery import app
from ramdeck_site.roles import can_administer, can_view
from remote.text import printable

logger = logging.getLogger(__name__)

# The Celery task that runs a job (jobs/tasks.py), sent by name so this module needs no import of it.
RUN_TASK = "jobs.tasks.run_job"
# Job.result's length.
RESULT_LIMIT = 500


class JobState(models.TextChoices):
    """queued → running → succeeded | failed | errored | needs_approval | cancelled.

    `failed` means the command ran and reported failure (non-zero exit, a check that did not pass);
    `errored` means it could not run at all or its worker died (unreachable host, worker lost).
    `needs_approval` means nothing went wrong but nothing ran either: the node offered an SSH host key no
    admin has approved (a first contact, or a key that changed), and the job page and the node page show
    the key with its Approve button. `cancelled` is an operator's decision. A queued job may also go
    straight to `cancelled` or `errored`.
    """

    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"
    ERRORED = "errored", "Errored"
    NEEDS_APPROVAL = "needs_approval", "Needs approval"
    CANCELLED = "cancelled", "Cancelled"


ACTIVE_STATES = (JobState.QUEUED, JobState.RUNNING)
TERMINAL_STATES = (
    JobState.SUCCEEDED,
    JobState.FAILED,
    JobState.ERRORED,
    JobState.NEEDS_APPROVAL,
    JobState.CANCELLED,
)


class LocalNodeRefused(PermissionDenied):
    """Work on the console's own host asked for by someone who is not an admin."""


def may_use_local_node(user, node) -> bool:
    """False for a person without the admin role asking for work on the console's own host."""
    if node is None or user is None or not getattr(node, "is_local", False):
        return True

    return can_administer(user)


def refuse_local_node(user, node, what: str = "Jobs", *, request=None) -> None:
    """Raise LocalNodeRefused when `node` is the console's own host (the local transport) and `user` is a
    person without the admin role.

    Whatever runs there runs as the console's own user, beside its encryption key and database: a build's
    CMakeLists, a download's file, a command. So every job on such a node, and every model registered or
    downloaded there, needs an admin. `user` None is the console itself (the monitor, the sweeper, a
    periodic probe): allowed. Job.save() asks this of every new job, whichever view or task creates it;
    views ask first, with the request, so the refusal is in the audit history (outside their transaction).
    """
    if may_use_local_node(user, node):
        return
    if request is not None:
        history.record(
            request,
            "permission_denied",
            node,
            changes={"path": request.path, "method": request.method, "needed": "admin", "local_node": True},
        )
    raise LocalNodeRefused(
        f"{what} on {node.name}, the console's own host, need the admin role: whatever runs there runs "
        "as the console's user, beside its keys and database."
    )


def may_read_log(user, job: Job) -> bool:
    """Whether `user` may read `job`'s log (its page, its live socket, its download).

    What a job on the console's own host printed ran as the console's user and may show its secrets (a
    command's output, a build's environment), so only admins read those logs. A job whose node was deleted
    can no longer tell where it ran, and counts as one of them. Viewers read every other log.
    """

    if not can_view(user):
        return False
    if job.node_id is not None and not job.node.is_local:
        return True
    return can_administer(user)


def refuse_log(request, job: Job) -> None:
    """Raise LocalNodeRefused (after an audit entry) when the request's user may not read `job`'s log."""
    if may_read_log(request.user, job):
        return

    history.record(
        request,
        "permission_denied",
        job,
        changes={"path": request.path, "method": request.method, "needed": "admin", "local_node": True},
    )
    where = (
        f"{job.node.name}, the console's own host"
        if job.node_id is not None
        else "a node since deleted, perhaps the console's own host"
    )
    raise LocalNodeRefused(
        f"This job ran on {where}: its log needs the admin role, since whatever ran there ran as the "
        "console's user and may have printed its secrets."
    )


class JobQuerySet(models.QuerySet):
    def active(self):
        return self.filter(state__in=ACTIVE_STATES)


class Job(models.Model):
    # Kinds are registered by the apps that own them (jobs/kinds.py): a new kind needs no migration.
    kind = models.CharField(max_length=20, choices=kinds.choices)
    # A step of a larger job (a deployment run's reap, rpc_server, ...): run by its parent's body through
    # `ctx.run_child`, never sent to a worker of its own.
    parent = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.CASCADE, related_name="children"
    )
    node = models.ForeignKey(
        "nodes.Node", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    # A copy of the node's name so the history still reads well after the node is deleted.
    node_name = models.CharField(max_length=100, blank=True)
    state = models.CharField(max_length=20, choices=JobState.choices, default=JobState.QUEUED, db_index=True)
    title = models.CharField(max_length=200, blank=True)
    # Non-secret parameters of the job (argument lists, ports, paths). Never a password or key.
    params = models.JSONField(default=dict, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    result = models.CharField(max_length=500, blank=True, help_text="One line a person can act on.")
    # Bookkeeping for the runner and the sweeper of lost jobs.
    worker = models.CharField(max_length=200, blank=True)
    # The PID of the process running the job on the worker's host (a prefork child): a redelivery on the
    # same host can tell at once that the run it finds is dead.
    runner_pid = models.PositiveIntegerField(null=True, blank=True)
    # When the task message was last sent, and how often: the sweeper sends again a job whose message
    # was lost (a Redis restart, a failed publish) and gives up after a few tries.
    enqueued_at = models.DateTimeField(null=True, blank=True)
    enqueue_count = models.PositiveSmallIntegerField(default=0)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    remote_pid = models.IntegerField(null=True, blank=True)
    cancel_requested = models.BooleanField(default=False)
    next_seq = models.PositiveIntegerField(default=0)

    objects = JobQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.get_kind_display()} #{self.pk} on {self.node_name or 'console'}"

    @property
    def kind_spec(self) -> kinds.Kind | None:
        return kinds.get(self.kind)

    @property
    def notify_groups(self) -> list[str]:
        """Channel groups that hear this job's status and lines besides its own (params["notify"]): the
        page of what the job is part of, such as a deployment's."""
        groups = self.params.get("notify") or []
        return [str(group) for group in groups] if isinstance(groups, list) else []

    def get_absolute_url(self) -> str:
        return reverse("jobs:detail", args=[self.pk])

    def may_be_opened_by(self, user) -> bool:
        """Whether the job's page opens for `user` (templates ask before linking to it: `user|may:job`)."""
        return may_read_log(user, self)

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def is_terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def duration(self):
        if not self.started_at:
            return None
        return (self.finished_at or timezone.now()) - self.started_at

    def save(self, *args, **kwargs):
        if self._state.adding and self.node_id and self.created_by_id:
            refuse_local_node(self.created_by, self.node)
        if self.node_id and not self.node_name:
            self.node_name = self.node.name
        super().save(*args, **kwargs)

    # State changes. Each is a conditional UPDATE so a redelivered task or a racing sweeper cannot
    # move a job backwards; each returns whether it changed anything.

    def enqueue(self) -> None:
        """Send the job to a worker once the transaction that created it commits (at once outside one).

        A message that cannot be sent (the broker is away) is logged, not raised: the job stays queued
        and the sweeper sends it again.
        """
        if self.parent_id:
            raise ValueError(f"Job {self.pk} is a step of job {self.parent_id}: its parent runs it.")
        transaction.on_commit(self.send_to_worker)

    def send_to_worker(self) -> bool:
        """Publish the run task now, on the kind's queue; True when the broker took it."""

        Job.objects.filter(pk=self.pk).update(
            enqueued_at=timezone.now(), enqueue_count=F("enqueue_count") + 1
        )
        try:
            app.send_task(RUN_TASK, args=[self.pk], queue=kinds.queue_for(self.kind))
        except Exception as exc:
            logger.warning(
                "Job %s: could not send it to a worker (%s); the sweeper will retry.", self.pk, exc
            )
            return False
        return True

    def mark_running(self, worker: str = "", runner_pid: int | None = None) -> bool:
        now = timezone.now()
        changed = Job.objects.filter(pk=self.pk, state=JobState.QUEUED).update(
            state=JobState.RUNNING, started_at=now, heartbeat_at=now, worker=worker, runner_pid=runner_pid
        )
        if changed:
            self.state, self.started_at, self.heartbeat_at, self.worker = JobState.RUNNING, now, now, worker
            self.runner_pid = runner_pid
        return bool(changed)

    def finish(self, state: str, *, exit_code: int | None = None, result: str = "") -> bool:
        if state not in TERMINAL_STATES:
            raise ValueError(f"{state!r} is not a terminal state")
        now = timezone.now()
        # A result often quotes what the node said (an OS name, a version, the last lines of an error):
        # printable only, as every string a node reports (remote/text.py).
        result = printable(result, RESULT_LIMIT, lines=True)
        changed = Job.objects.filter(pk=self.pk, state__in=ACTIVE_STATES).update(
            state=state, finished_at=now, exit_code=exit_code, result=result
        )
        if changed:
            self.state, self.finished_at, self.exit_code, self.result = state, now, exit_code, result
        return bool(changed)

    def request_cancel(self) -> bool:
        """Cancel a queued job at once; ask the runner to end a running one.

        The queued case is one conditional UPDATE: a check followed by `finish()` (which accepts a
        running job too) would mark a job the runner claimed in between as cancelled while its
        process runs on, without ever asking the runner to stop it.
        """
        now, result = timezone.now(), "Cancelled before it started."
        if Job.objects.filter(pk=self.pk, state=JobState.QUEUED).update(
            state=JobState.CANCELLED, finished_at=now, result=result
        ):
            self.state, self.finished_at, self.result = JobState.CANCELLED, now, result
            self.skip_queued_children("Skipped: the job was cancelled before it started.")
            return True
        changed = Job.objects.filter(pk=self.pk, state=JobState.RUNNING).update(cancel_requested=True)
        self.cancel_requested = self.cancel_requested or bool(changed)
        return bool(changed)

    def skip_queued_children(self, reason: str) -> int:
        """Steps that never began never will (the parent ended): cancelled, with the reason."""
        return Job.objects.filter(parent_id=self.pk, state=JobState.QUEUED).update(
            state=JobState.CANCELLED, finished_at=timezone.now(), result=reason[:500]
        )

    def touch(self) -> None:
        self.heartbeat_at = timezone.now()
        Job.objects.filter(pk=self.pk).update(heartbeat_at=self.heartbeat_at)

    def record_remote_pid(self, pid: int | None) -> None:
        self.remote_pid = pid
        Job.objects.filter(pk=self.pk).update(remote_pid=pid)

    def append_lines(self, lines: list[tuple[str, str]]) -> list[tuple[int, str, str]]:
        """Store (stream, text) lines with gap-free sequence numbers; return them as (seq, stream, text).

        The sequence block is reserved with one UPDATE ... RETURNING-free increment inside the same
        transaction as the insert, so concurrent writers never interleave or leave holes. The rows go
        in with one `executemany` rather than `bulk_create`: building a model instance per line cost
        more than the insert itself, and a build log has hundreds of thousands of lines.
        """
        if not lines:
            return []
        alias = router.db_for_write(JobLogLine)
        connection = connections[alias]
        with transaction.atomic(using=alias):
            Job.objects.using(alias).filter(pk=self.pk).update(next_seq=F("next_seq") + len(lines))
            end = Job.objects.using(alias).filter(pk=self.pk).values_list("next_seq", flat=True).get()
            start = end - len(lines)
            # PostgreSQL text cannot hold NUL: the transports drop it from command output (decode_line), and
            # this drops it from whatever else a body logs.
            saved = [(start + i, stream, text.replace("\x00", "")) for i, (stream, text) in enumerate(lines)]
            now = connection.ops.adapt_datetimefield_value(timezone.now())
            quote = connection.ops.quote_name
            columns = ", ".join(quote(c) for c in ("job_id", "seq", "stream", "text", "created_at"))
            with connection.cursor() as cursor:
                cursor.executemany(
                    f"INSERT INTO {quote(JobLogLine._meta.db_table)} ({columns}) VALUES (%s, %s, %s, %s, %s)",
                    [(self.pk, seq, stream, text, now) for seq, stream, text in saved],
                )
        self.next_seq = end
        return saved

    def trim_log(self, keep_head: int, keep_tail: int) -> int:
        """Keep the first `keep_head` and the last `keep_tail` lines; the ones between are deleted and one
        marker line (at the first cut seq) says how many. Returns how many lines were deleted. A job that
        prints without end cannot fill the database; what matters most (how it started, how it ended) stays.
        """
        alias = router.db_for_write(JobLogLine)
        with transaction.atomic(using=alias):
            end = Job.objects.using(alias).filter(pk=self.pk).values_list("next_seq", flat=True).get()
            first, last = keep_head, end - keep_tail - 1
            if last <= first:
                return 0
            lines = JobLogLine.objects.using(alias).filter(job_id=self.pk, seq__gte=first, seq__lte=last)
            deleted, _ = lines.delete()
            JobLogLine.objects.using(alias).create(
                job_id=self.pk,
                seq=first,
                stream=LogStream.SYSTEM,
                text=cut_marker(first, last, keep_head, keep_tail),
            )
        return deleted - 1 if deleted else 0


def cut_marker(first: int, last: int, keep_head: int, keep_tail: int) -> str:
    return (
        f"[… {last - first + 1} lines cut here (lines {first + 1}–{last + 1}): the console keeps the first "
        f"{keep_head} and the last {keep_tail} lines of a job (RAMDECK_JOB_LOG_MAX_LINES) …]"
    )


class LogStream(models.TextChoices):
    STDOUT = "out", "stdout"
    STDERR = "err", "stderr"
    SYSTEM = "sys", "console"


class JobLogLine(models.Model):
    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="log_lines")
    seq = models.PositiveIntegerField()
    stream = models.CharField(max_length=3, choices=LogStream.choices, default=LogStream.STDOUT)
    text = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["job", "seq"]
        constraints = [models.UniqueConstraint(fields=["job", "seq"], name="unique_job_log_seq")]

    def __str__(self) -> str:
        return f"{self.job_id}:{self.seq} {self.text[:60]}"
