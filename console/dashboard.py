"""The dashboard's live regions: device gauges, running deployments with their speed over the last hour,
failed jobs of the last day and stale processes. One function gathers them for the page, for the websocket
consumer (console/consumers.py) that renders them again on every change, and for the polling fallback.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from deployments.charts import bars, sparkline
from deployments.lifecycle.actions import local_refusal
from deployments.models import ACTIVE_STATES, Deployment, DeploymentState, SpeedSample, StaleProcess
from jobs.models import Job, JobState
from nodes.models import Node, Reachability
from nodes.probe.job import PROBE
from ramdeck_site.roles import can_operate

FAILED_JOBS_SINCE = timedelta(days=1)
FAILED_JOBS_SHOWN = 10
# The templates that render the regions, each with its own id (swapped out of band when live).
REGIONS = (
    "console/dashboard/_memory.html",
    "console/dashboard/_deployments.html",
    "console/dashboard/_gauges.html",
    "console/dashboard/_failed_jobs.html",
    "deployments/stale.html#region",
)


def running_rows(deployments: list[Deployment], now) -> list[dict]:
    """Each active deployment with its sparkline of the last hour's decode speed."""
    since = now - sparkline.WINDOW
    samples: dict[int, list] = {d.pk: [] for d in deployments}
    rows = SpeedSample.objects.filter(deployment__in=deployments, at__gte=since).order_by("at", "pk")
    for deployment_id, at, tps in rows.values_list("deployment_id", "at", "tokens_per_s"):
        samples[deployment_id].append((at, tps))
    return [{"deployment": d, "speed": sparkline.sparkline(samples[d.pk], now)} for d in deployments]


def failed_jobs(now):
    """Top-level jobs that failed or errored in the last day (a run's failed step is told by its run).

    Not the probes of a node that is offline now (the dashboard's one line about it says so) nor of a node
    since deleted (its hardware history went with it)."""
    return (
        Job.objects.filter(
            parent__isnull=True,
            state__in=[JobState.FAILED, JobState.ERRORED],
            finished_at__gte=now - FAILED_JOBS_SINCE,
        )
        .exclude(kind=PROBE, node__isnull=True)
        .exclude(kind=PROBE, node__reachability=Reachability.UNREACHABLE)
        .select_related("node")
        .order_by("-finished_at", "-pk")[:FAILED_JOBS_SHOWN]
    )


def not_working_rows(deployments: list[Deployment], user) -> list[dict]:
    """Each degraded deployment with what went wrong in a sentence, and whether `user` may restart it."""
    return [
        {
            "deployment": d,
            "sentence": d.trouble(),
            "may_restart": user is not None and can_operate(user) and not local_refusal(d, user),
        }
        for d in deployments
    ]


def live_context(now=None, user=None) -> dict:
    """The regions' context; `user` decides which buttons are offered."""
    now = now or timezone.now()
    deployments = list(
        Deployment.objects.filter(state__in=ACTIVE_STATES).select_related("model_file", "coordinator")
    )
    # A degraded deployment is not working (a process of it ended, a node went away): it is told apart,
    # with a sentence and a Restart button, not listed as running.
    degraded = [d for d in deployments if d.state == DeploymentState.DEGRADED]
    nodes = Node.objects.filter(enabled=True).prefetch_related("devices").order_by("name")
    gauges = bars.device_gauges(nodes, deployments)
    return {
        "gauges": gauges,
        # The summary tile's numbers are the bars' own.
        "memory": bars.gauge_totals(gauges),
        "running": running_rows([d for d in deployments if d not in degraded], now),
        "not_working": not_working_rows(degraded, user),
        "failed_jobs": list(failed_jobs(now)),
        # The stale-process region (deployments/stale.html) calls them rows.
        "rows": list(StaleProcess.objects.select_related("node")),
    }
