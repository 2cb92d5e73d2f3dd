"""A deployment's page, live: its channel group, and the message that says "look again".

The deployment's runs and steps name this group in their params["notify"], so their status changes and
log lines reach it (jobs/broadcast.py); the deployment's own state changes and recorded facts send
`deployment.changed` here after their transaction commits. The consumer (deployments/consumers.py)
answers any of them by rendering the page's live regions again.
"""

from __future__ import annotations

from django.db import transaction

from jobs import broadcast

# The dashboard's watchers (console/consumers.py) hear every deployment's changes too, and the job
# list's group (every job's state).
DASHBOARD_GROUP = "dashboard"


def group_name(deployment_id: int) -> str:
    return f"deployment-{deployment_id}"


async def _send_to(groups: tuple[str, ...], message: dict) -> None:
    for group in groups:
        await broadcast.send_event(group, message)


def changed(deployment_id: int) -> None:
    """Tell the deployment's watchers and the dashboard's, once the current transaction (if any) has
    committed."""
    message = {"type": "deployment.changed", "deployment_id": deployment_id}
    groups = (group_name(deployment_id), DASHBOARD_GROUP)
    transaction.on_commit(lambda: broadcast.call_sync(_send_to, groups, message))


def dashboard_changed() -> None:
    """Something only the dashboard shows changed (the stale processes found by a scan)."""
    message = {"type": "dashboard.changed"}
    transaction.on_commit(lambda: broadcast.call_sync(_send_to, (DASHBOARD_GROUP,), message))
