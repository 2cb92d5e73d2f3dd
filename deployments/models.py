"""GGUF model files and deployments (a confirmed plan and everything that happened to it since)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.urls import reverse
from django.utils import timezone

from ramdeck_site import crypto


class ModelFile(models.Model):
    """A GGUF model on a node. `profile` is the parsed memory profile (deployments/gguf_profile.py)."""

    name = models.CharField(max_length=200, unique=True)
    node = models.ForeignKey("nodes.Node", on_delete=models.PROTECT, related_name="model_files")
    path = models.CharField(max_length=1000, help_text="Path of the (first) GGUF file on the node.")
    shard_paths = models.JSONField(default=list, blank=True, help_text="Every shard, first included.")
    size_bytes = models.BigIntegerField(default=0)
    sha256 = models.CharField(max_length=64, blank=True)
    profile = models.JSONField(default=dict)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]
        constraints = [models.UniqueConstraint(fields=["node", "path"], name="unique_model_path_per_node")]

    def __str__(self) -> str:
        return self.name


class DeploymentState(models.TextChoices):
    """The life of a deployment.

        confirmed ──deploy──► preparing ──► launching ──► verifying ──► running ──stop──► stopping ──► stopped
                                  │             │             │            │   ▲              │
                                  └─────────────┴──────┬──────┘            ▼   │ (recovers)   │
                                                       ▼                degraded ──stop───────┘
                                                     failed (step and reason kept; what it started is rolled back)

    preparing: reap stale processes and check builds; launching: rpc-servers, then llama-server;
    verifying: compare llama.cpp's logged placement with the plan and measure speed. A stopped or failed
    deployment can be redeployed, which creates a new deployment from the same plan.
    """

    CONFIRMED = "confirmed", "Confirmed"
    PREPARING = "preparing", "Preparing"
    LAUNCHING = "launching", "Launching"
    VERIFYING = "verifying", "Verifying"
    RUNNING = "running", "Running"
    DEGRADED = "degraded", "Degraded"
    STOPPING = "stopping", "Stopping"
    STOPPED = "stopped", "Stopped"
    FAILED = "failed", "Failed"


ACTIVE_STATES = (
    DeploymentState.PREPARING,
    DeploymentState.LAUNCHING,
    DeploymentState.VERIFYING,
    DeploymentState.RUNNING,
    DeploymentState.DEGRADED,
    DeploymentState.STOPPING,
)
TERMINAL_STATES = (DeploymentState.STOPPED, DeploymentState.FAILED)


class Deployment(models.Model):
    name = models.CharField(max_length=200)
    model_file = models.ForeignKey(ModelFile, on_delete=models.PROTECT, related_name="deployments")
    coordinator = models.ForeignKey("nodes.Node", on_delete=models.PROTECT, related_name="coordinated_deployments")
    # The immutable plan snapshot (deployments/planner.py output) and the settings it was planned with.
    plan = models.JSONField()
    plan_settings = models.JSONField(default=dict)
    state = models.CharField(
        max_length=20, choices=DeploymentState.choices, default=DeploymentState.CONFIRMED, db_index=True
    )
    state_reason = models.TextField(blank=True)
    failed_step = models.CharField(max_length=40, blank=True)
    host = models.CharField(max_length=253, default="127.0.0.1", help_text="llama-server --host")
    port = models.PositiveIntegerField(default=8080, help_text="llama-server --port")
    api_key_encrypted = models.TextField(blank=True, editable=False)
    redeployed_from = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    running_at = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    # What running it found: per-device placement from llama.cpp's log, measured speed, process PIDs.
    verification = models.JSONField(default=dict, blank=True)
    measured_decode_tps = models.FloatField(null=True, blank=True)
    measured_prompt_tps = models.FloatField(null=True, blank=True)
    processes = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.name} (#{self.pk})"

    def get_absolute_url(self) -> str:
        return reverse("deployments:detail", args=[self.pk])

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES

    def set_api_key(self, key: str) -> None:
        self.api_key_encrypted = crypto.encrypt(key)

    def api_key(self) -> str:
        return crypto.decrypt(self.api_key_encrypted)
