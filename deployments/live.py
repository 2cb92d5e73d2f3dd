"""A deployment's page, live: its channel group, and the message that says "look again".

The deployment's runs and steps name this group in their params["notify"], so their status changes and
log lines reach it (jobs/broadcast.py); the deployment's own state changes and recorded facts send
`deployment.changed` here after their transaction commits. The consumer (deployments/consumers.py)
answers any of them by rendering the page's live regions again.
"""

from __future__ import annotations

from django.db import transaction

from jobs import broadcast


def group_name(deployment_id: int) -> str:
    return f"deployment-{deployment_id}"


def changed(deployment_id: int) -> None:
    """Tell the deployment's watchers, once the current transaction (if any) has committed."""
    message = {"type": "deployment.changed", "deployment_id": deployment_id}
    transaction.on_commit(
        lambda: broadcast.call_sync(broadcast.send_event, group_name(deployment_id), message)
    )
