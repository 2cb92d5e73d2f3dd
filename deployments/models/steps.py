"""The jobs of a deployment's runs in order, and the stale processes the periodic scan finds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import models
from django.utils import timezone

if TYPE_CHECKING:
    pass


class DeploymentStep(models.Model):
    """One job of a deployment's ordered run (reap, rpc-server, llama-server, verify, measure, stop)."""

    deployment = models.ForeignKey("deployments.Deployment", on_delete=models.CASCADE, related_name="steps")
    job = models.OneToOneField("jobs.Job", on_delete=models.CASCADE, related_name="deployment_step")
    name = models.CharField(max_length=40)
    order = models.PositiveIntegerField()

    class Meta:
        ordering = ["deployment", "order", "pk"]

    def __str__(self) -> str:
        return f"#{self.deployment_id} step {self.order} {self.name}"


class StaleProcess(models.Model):
    """An rpc-server or llama-server of ours that the periodic scan found holding a port and that belongs to
    no active deployment (left by a crash, or started by hand). The dashboard offers a one-click reap."""

    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="stale_processes")
    port = models.PositiveIntegerField()
    pid = models.PositiveIntegerField()
    program = models.CharField(max_length=40)
    cmdline = models.TextField(blank=True)
    first_seen_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node__name", "port"]
        constraints = [models.UniqueConstraint(fields=["node", "port", "pid"], name="unique_stale_process")]

    def __str__(self) -> str:
        return f"{self.program} PID {self.pid} on {self.node.name}:{self.port}"
