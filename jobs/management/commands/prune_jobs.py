"""Delete jobs that ended long ago, with their steps and log lines; the audit history is kept (and says so).

manage.py prune_jobs --days 90 [--dry-run]
"""

from __future__ import annotations

from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit.history import record
from jobs.models import ACTIVE_STATES, TERMINAL_STATES, Job, JobLogLine


class Command(BaseCommand):
    help = "Delete jobs (and their steps and log lines) that ended more than --days days ago."

    def add_arguments(self, parser):
        parser.add_argument(
            "--days", type=int, required=True, help="Keep jobs that ended within this many days."
        )
        parser.add_argument("--dry-run", action="store_true", help="Only say what would be deleted.")

    def handle(self, *args, days: int, dry_run: bool, **options):
        if days < 1:
            raise CommandError("--days must be at least 1: a job that is still running is never deleted.")
        cutoff = timezone.now() - timedelta(days=days)
        # Whole jobs only: a run and its steps go together, and only once all of them have ended.
        old = Job.objects.filter(parent__isnull=True, state__in=TERMINAL_STATES).filter(
            Q(finished_at__lt=cutoff) | Q(finished_at__isnull=True, created_at__lt=cutoff)
        )
        old = old.exclude(children__state__in=ACTIVE_STATES)
        ids = list(old.values_list("pk", flat=True))
        family = Job.objects.filter(Q(pk__in=ids) | Q(parent_id__in=ids))
        jobs, lines = family.count(), JobLogLine.objects.filter(job__in=family).count()
        verb = "Would delete" if dry_run else "Deleted"
        if not dry_run and jobs:
            with transaction.atomic():
                family.filter(parent__isnull=False).delete()
                Job.objects.filter(pk__in=ids).delete()
                record(
                    None,
                    "jobs.pruned",
                    object_type="job",
                    changes={"jobs": jobs, "log_lines": lines, "older_than_days": days},
                    actor_name="retention",
                )
        self.stdout.write(
            f"{verb} {jobs} job(s) that ended before {cutoff:%Y-%m-%d %H:%M} and {lines} log line(s)."
        )
