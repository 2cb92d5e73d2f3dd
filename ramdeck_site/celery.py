"""The Celery application. Tasks live in each app's tasks.py; beat's schedule is set here."""

from __future__ import annotations

import os

from celery import Celery
from django.conf import settings

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ramdeck_site.settings")

app = Celery("ramdeck")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@app.on_after_finalize.connect
def _schedule_periodic_work(sender, **kwargs):
    schedule = {}
    if settings.RAMDECK_PROBE_INTERVAL_S:
        schedule["probe-all-nodes"] = {
            "task": "nodes.tasks.probe_all_nodes",
            "schedule": float(settings.RAMDECK_PROBE_INTERVAL_S),
        }
    schedule["sweep-lost-jobs"] = {
        "task": "jobs.tasks.sweep_lost_jobs",
        "schedule": float(settings.RAMDECK_SWEEP_INTERVAL_S),
    }
    sender.conf.beat_schedule = {**schedule, **settings.CELERY_BEAT_SCHEDULE}
