"""What the monitor samples of a running deployment: its decode speed over time."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import models
from django.utils import timezone

if TYPE_CHECKING:
    from deployments.models.deployment import Deployment


class SpeedSample(models.Model):
    """A running deployment's decode speed between two of the monitor's looks at llama-server's /metrics.

    llama-server counts the tokens it generated and the seconds it spent generating them since it started;
    the speed over an interval is the ratio of their differences, whoever else read /metrics in between.
    An interval with no generation has no speed (`tokens_per_s` is None): the sparkline shows a gap."""

    deployment = models.ForeignKey(
        "deployments.Deployment", on_delete=models.CASCADE, related_name="speed_samples"
    )
    at = models.DateTimeField(default=timezone.now, db_index=True)
    tokens_total = models.FloatField(null=True, blank=True)
    generation_seconds_total = models.FloatField(null=True, blank=True)
    tokens_per_s = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["deployment", "at", "pk"]

    def __str__(self) -> str:
        return f"#{self.deployment_id} at {self.at:%H:%M:%S}: {self.tokens_per_s} tok/s"

    @classmethod
    def record(cls, deployment: Deployment, metrics: dict[str, str], at=None) -> SpeedSample | None:
        """A sample from /metrics numbers (deployments/monitor.py parse_metrics); None without them."""
        tokens = _number(metrics.get("tokens_predicted_total"))
        seconds = _number(metrics.get("tokens_predicted_seconds_total"))
        if tokens is None or seconds is None:
            return None
        previous = cls.objects.filter(deployment=deployment).order_by("-at", "-pk").first()
        base_tokens = base_seconds = 0.0  # the first sample, or llama-server started again (and its counters)
        if previous is not None and previous.tokens_total is not None:
            earlier_seconds = previous.generation_seconds_total or 0.0
            if tokens >= previous.tokens_total and seconds >= earlier_seconds:
                base_tokens, base_seconds = previous.tokens_total, earlier_seconds
        d_tokens, d_seconds = tokens - base_tokens, seconds - base_seconds
        tps = d_tokens / d_seconds if d_tokens > 0 and d_seconds > 0 else None
        return cls.objects.create(
            deployment=deployment,
            at=at or timezone.now(),
            tokens_total=tokens,
            generation_seconds_total=seconds,
            tokens_per_s=tps,
        )


def _number(value) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
