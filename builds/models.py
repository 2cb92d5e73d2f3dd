"""llama.cpp builds on nodes: where each came from and what it can speak."""

from __future__ import annotations

from django.db import models
from django.utils import timezone


class BuildSource(models.TextChoices):
    GIT = "git", "Git URL and ref"
    TARBALL = "tarball", "Source tarball"
    EXISTING = "existing", "Existing install"


class Build(models.Model):
    """A llama.cpp build on a node: where it came from and what it can speak.

    The newest build of a node is the one deployments use (`Node.current_build`). Two nodes can serve
    one deployment only when their builds speak the same RPC protocol version.
    """

    node = models.ForeignKey("nodes.Node", on_delete=models.CASCADE, related_name="builds")
    source_kind = models.CharField(max_length=10, choices=BuildSource.choices)
    # Git URL and ref, the tarball's file name, or the path of an existing install.
    source = models.CharField(max_length=1000, blank=True)
    ref = models.CharField(max_length=200, blank=True)
    tarball_sha256 = models.CharField(max_length=64, blank=True)
    backend = models.CharField(max_length=20, default="cpu")
    flags = models.JSONField(default=list, blank=True)
    version = models.CharField(max_length=200, blank=True, help_text="What llama-server --version says.")
    rpc_binary = models.CharField(max_length=40, default="ggml-rpc-server")
    rpc_protocol = models.CharField(max_length=20, blank=True, help_text="RPC protocol version, e.g. 7.0.0.")
    build_dir = models.CharField(max_length=1000, blank=True)
    # What its rpc-server's banner listed at registration: [{"name", "description", "total_mib", "free_mib"}].
    # The planner may place on these (and the CPU, which every build has); None: not known (a build recorded
    # before this was read, or a release whose banner lists no devices).
    devices = models.JSONField(null=True, blank=True)
    rpc_server_path = models.CharField(max_length=1000)
    llama_server_path = models.CharField(max_length=1000)
    job_id = models.IntegerField(null=True, blank=True, help_text="The build job that produced it.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def offered_devices(self) -> set[str] | None:
        """The device names this build serves: its banner's, and the CPU, whose backend every build has (the
        rpc-server lists it only when it has no GPU, since it serves its GPUs by default). None: unknown."""
        if self.devices is None:
            return None
        return {"CPU", *(str(d.get("name", "")) for d in self.devices if isinstance(d, dict))}

    def banner_device(self, name: str) -> dict | None:
        """What the banner said of one device ({"total_mib", "free_mib", ...}), if it listed it."""
        return next((d for d in self.devices or [] if isinstance(d, dict) and d.get("name") == name), None)

    def __str__(self) -> str:
        what = self.version or self.ref or self.source_kind
        return f"{self.node.name}: llama.cpp {what} (RPC {self.rpc_protocol})"
