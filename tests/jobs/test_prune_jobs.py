"""The retention command: jobs that ended long ago go with their steps and log lines; the rest stays, and
the audit history says what was pruned."""

from __future__ import annotations

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from audit.models import AuditEvent
from jobs.models import Job, JobLogLine, JobState

pytestmark = pytest.mark.django_db


def _job(days_ago: float, state=JobState.SUCCEEDED, parent=None, lines: int = 3) -> Job:
    job = Job.objects.create(kind="command", parent=parent, params={"argv": ["true"]})
    job.append_lines([("out", f"line {i}") for i in range(lines)])
    when = timezone.now() - timedelta(days=days_ago)
    finished = when if state not in (JobState.QUEUED, JobState.RUNNING) else None
    Job.objects.filter(pk=job.pk).update(state=state, created_at=when, finished_at=finished)
    return job


def prune(*args: str) -> str:
    out = StringIO()
    call_command("prune_jobs", *args, stdout=out)
    return out.getvalue()


def test_old_jobs_go_with_their_steps_and_lines_and_recent_or_active_ones_stay():
    old_run = _job(100)
    old_step = _job(100, parent=old_run)
    recent = _job(5)
    stuck = _job(100, state=JobState.RUNNING)

    assert prune("--days", "30", "--dry-run").startswith("Would delete 2 job(s)")
    assert Job.objects.count() == 4

    assert "Deleted 2 job(s)" in prune("--days", "30")
    assert set(Job.objects.values_list("pk", flat=True)) == {recent.pk, stuck.pk}
    assert not JobLogLine.objects.filter(job_id__in=[old_run.pk, old_step.pk]).exists()
    event = AuditEvent.objects.get(action="jobs.pruned")
    assert event.changes == {"jobs": 2, "log_lines": 6, "older_than_days": 30}


def test_zero_days_is_refused_with_a_reason():
    with pytest.raises(CommandError, match="at least 1"):
        prune("--days", "0")
