"""What the node page's Calibrate control offers, now: a node that serves a running deployment is not
calibrated on its own (the job would fail at once), so the page offers to stop that deployment, calibrate
and start it again, or says why nothing can run."""

from __future__ import annotations

from django import template

from calibration.store import refusal, serving
from deployments.lifecycle.actions import recalibrate_refusal
from ramdeck_site.roles import may_use

register = template.Library()


@register.simple_tag(takes_context=True)
def calibration_offer(context, node) -> dict:
    """{"ok": True}: Calibrate. {"around": deployment}: "Stop it, calibrate, start again" (one run,
    deployments:recalibrate). {"reason": "..."}: why not now, shown next to a disabled button."""
    reason = refusal(node)
    if not reason:
        return {"ok": True}
    held_by = serving(node)
    user = context.get("user")
    if len(held_by) == 1 and user and may_use(user, "deployments:recalibrate"):
        why = recalibrate_refusal(held_by[0], node, user)
        if not why:
            return {"around": held_by[0]}
        reason = why
    return {"reason": reason}
