"""Nodes (machines the console reaches), their devices, credentials and pinned SSH host keys."""

from __future__ import annotations

import ntpath
import posixpath
import shlex
from datetime import timedelta
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models, transaction
from django.urls import reverse
from django.utils import timezone
from django.utils.text import slugify
from django.utils.timesince import timesince

from audit import history
from llamacpp import rpc_cache
from llamacpp.rpc_guard import binds_everywhere
from nodes.probe.wsl import WindowsSide, windows_side
from nodes.validators import validate_cache_folder, validate_host
from ramdeck_site import crypto
from remote.text import printable

if TYPE_CHECKING:
    from builds.models import Build


class CredentialKind(models.TextChoices):
    PRIVATE_KEY = "private_key", "Private key"
    PASSWORD = "password", "Password"


class Credential(models.Model):
    """An SSH login secret, encrypted at rest; decrypted only when a connection is made."""

    name = models.CharField(max_length=100, unique=True)
    kind = models.CharField(max_length=20, choices=CredentialKind.choices, default=CredentialKind.PRIVATE_KEY)
    secret_encrypted = models.TextField(editable=False)
    passphrase_encrypted = models.TextField(blank=True, editable=False)
    # Non-secret description shown on pages: the public key's fingerprint for keys.
    public_fingerprint = models.CharField(max_length=200, blank=True, editable=False)
    # The public half of a private key (OpenSSH one-line format), not secret: the credential page shows it
    # with the line that puts it into a node's authorized_keys.
    public_key = models.TextField(blank=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def set_secret(self, secret: str, passphrase: str = "") -> None:
        self.secret_encrypted = crypto.encrypt(secret)
        self.passphrase_encrypted = crypto.encrypt(passphrase)

    def secret(self) -> str:
        return crypto.decrypt(self.secret_encrypted)

    def passphrase(self) -> str:
        return crypto.decrypt(self.passphrase_encrypted)

    @property
    def authorized_keys_command(self) -> str:
        """The shell line to run on a node, as the user the console logs in as, to let this key in."""
        if not self.public_key:
            return ""
        key = shlex.quote(self.public_key.strip())
        return (
            "umask 077 && mkdir -p ~/.ssh && "
            f"grep -qxF {key} ~/.ssh/authorized_keys 2>/dev/null || echo {key} >> ~/.ssh/authorized_keys"
        )

    @property
    def public_key_file_name(self) -> str:
        return f"ramdeck-{slugify(self.name) or 'key'}.pub"

    def rotate_encryption(self) -> None:
        self.secret_encrypted = crypto.rotate(self.secret_encrypted)
        self.passphrase_encrypted = crypto.rotate(self.passphrase_encrypted)
        self.save(update_fields=["secret_encrypted", "passphrase_encrypted"])


class Transport(models.TextChoices):
    SSH = "ssh", "SSH"
    LOCAL = "local", "Local (this console's own host)"


class PlatformHint(models.TextChoices):
    AUTO = "auto", "Detect"
    LINUX = "linux", "Linux"
    MACOS = "macos", "macOS"
    WINDOWS = "windows", "Windows"


class Reachability(models.TextChoices):
    UNKNOWN = "unknown", "Not probed yet"
    REACHABLE = "reachable", "Reachable"
    UNREACHABLE = "unreachable", "Unreachable"
    HOST_KEY_PENDING = "host_key_pending", "Host key awaits approval"
    HOST_KEY_CHANGED = "host_key_changed", "Host key changed"


port_validators = [MinValueValidator(1), MaxValueValidator(65535)]


# A node's last error quotes what the node or its SSH server said: cleaned and cut to this when stored.
LAST_ERROR_LIMIT = 2000


class Node(models.Model):
    name = models.SlugField(max_length=100, unique=True, help_text="Short name: letters, digits, - and _.")
    address = models.CharField(
        max_length=253, validators=[validate_host], help_text="Hostname or IP address."
    )
    transport = models.CharField(max_length=10, choices=Transport.choices, default=Transport.SSH)
    ssh_port = models.PositiveIntegerField(default=22, validators=port_validators)
    ssh_user = models.CharField(max_length=64, blank=True)
    credential = models.ForeignKey(
        Credential, null=True, blank=True, on_delete=models.PROTECT, related_name="nodes"
    )
    may_coordinate = models.BooleanField(
        default=False, help_text="This node may run llama-server (the coordinator) for a deployment."
    )
    rpc_port = models.PositiveIntegerField(default=50052, validators=port_validators)
    rpc_bind_address = models.CharField(
        max_length=253,
        blank=True,
        validators=[validate_host],
        help_text="Address ggml-rpc-server listens on. Empty: the node's own address.",
    )
    rpc_tunnel = models.BooleanField(
        default=True,
        help_text="Deployments may reach this node's ggml-rpc-server through an SSH tunnel "
        "(it then listens on 127.0.0.1 only).",
    )
    authorized_keys_path = models.CharField(
        max_length=500,
        blank=True,
        help_text="Where sshd reads the SSH user's authorized keys (a tunnel's key goes there). "
        "Empty: ~/.ssh/authorized_keys.",
    )
    platform_hint = models.CharField(max_length=10, choices=PlatformHint.choices, default=PlatformHint.AUTO)
    rpc_cache_limit_gib = models.PositiveIntegerField(
        "RPC cache limit (GiB)",
        default=rpc_cache.DEFAULT_LIMIT_GIB,
        validators=[MaxValueValidator(1_000_000)],
        help_text="Room on disk for ggml-rpc-server's tensor cache, which spares re-sending a model's "
        "weights at each start; the oldest entries go first before a deployment starts here. "
        "0 turns the cache off.",
    )
    llama_cache_dir = models.CharField(
        "llama.cpp cache folder",
        max_length=500,
        blank=True,
        validators=[validate_cache_folder],
        help_text="Absolute path given to ggml-rpc-server as LLAMA_CACHE (its entries go in its rpc/ "
        "folder). Empty: llama.cpp's default, ~/.cache/llama.cpp (~/Library/Caches/llama.cpp on macOS).",
    )
    # What the last look at the RPC cache found (nodes/cache.py): {"dir", "entries", "bytes", "free_bytes",
    # "read_at"}. Read over the node's transport by a job, never by a page.
    rpc_cache_state = models.JSONField(default=dict, blank=True, editable=False)
    notes = models.TextField(blank=True)
    enabled = models.BooleanField(default=True)

    # Pinned SSH host key. The first contact stores the offered key as pending; nothing runs on the
    # node until an admin approves it. A different key later blocks every job until re-approved.
    host_key = models.TextField(blank=True, help_text="Approved host public key (OpenSSH format).")
    host_key_fingerprint = models.CharField(max_length=100, blank=True)
    pending_host_key = models.TextField(blank=True)
    pending_host_key_fingerprint = models.CharField(max_length=100, blank=True)
    host_key_approved_at = models.DateTimeField(null=True, blank=True)
    host_key_approved_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    # What the last probe found. `facts` holds the parsed, non-secret details (OS, kernel, CPU,
    # binaries, port holder); devices are rows of their own.
    reachability = models.CharField(max_length=20, choices=Reachability.choices, default=Reachability.UNKNOWN)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    last_probe_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    facts = models.JSONField(default=dict, blank=True)
    rtt_ms = models.FloatField(null=True, blank=True)
    # When the console lost contact with it (None while it answers): the dashboard's one line about an
    # offline node, and the periodic probe's backoff, count from here.
    unreachable_since = models.DateTimeField(null=True, blank=True)

    # What the last calibration measured (calibration/job.py); the devices' own figures are on
    # their rows. `calibration` keeps the raw samples for the node page and for later comparison.
    calibrated_at = models.DateTimeField(null=True, blank=True)
    pass_overhead_ms = models.FloatField(
        null=True, blank=True, help_text="Fixed cost of one decode pass of llama-server here, per token."
    )
    rpc_hop_ms = models.FloatField(
        null=True, blank=True, help_text="Extra cost per token of computing through this node's rpc-server."
    )
    pipeline_overhead_ms = models.FloatField(
        null=True,
        blank=True,
        help_text="Extra cost per token, when this node coordinates, of splitting across several servers.",
    )
    link_rtt_ms = models.FloatField(
        null=True, blank=True, help_text="Console to this node's RPC port: one request and its answer."
    )
    link_throughput_mbs = models.FloatField(null=True, blank=True, help_text="MB/s into the RPC server.")
    calibration = models.JSONField(default=dict, blank=True)
    # The round trip from each coordinator to this node, measured on the coordinator (the console may sit
    # elsewhere): {"<coordinator pk>": {"coordinator": name, "rtt_ms": ..., "source": "calibration" or
    # "preflight", "measured_at": ISO time}}. The planner uses the pair's figure (nodes/pool.py).
    coordinator_links = models.JSONField(
        default=dict, blank=True, help_text="Round trip from each coordinator to this node, measured there."
    )

    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def get_absolute_url(self) -> str:
        return reverse("nodes:detail", args=[self.name])

    def link_rtt_from(self, coordinator: Node) -> float | None:
        """The round trip `coordinator` measured to this node, or None when it has measured none."""
        figure = (self.coordinator_links or {}).get(str(coordinator.pk)) or {}
        rtt = figure.get("rtt_ms")
        return float(rtt) if isinstance(rtt, int | float) else None

    def record_coordinator_link(self, coordinator: Node, rtt_ms: float, source: str) -> None:
        """Store the round trip `coordinator` measured to this node (replacing that pair's last one)."""
        with transaction.atomic():
            locked = type(self).objects.select_for_update().get(pk=self.pk)
            links = dict(locked.coordinator_links or {})
            links[str(coordinator.pk)] = {
                "coordinator": coordinator.name,
                "rtt_ms": round(float(rtt_ms), 3),
                "source": source,
                "measured_at": timezone.now().isoformat(),
            }
            locked.coordinator_links = links
            locked.save(update_fields=["coordinator_links"])
        self.coordinator_links = links

    @property
    def platform(self) -> str:
        """ "linux", "macos" or "windows", as the console must know it to build its commands: what the probe
        found on the node itself (the shell that answered its first connection, then the system that shell
        reported) over the operator's hint, which stands in until a probe has run. A hint that says Linux
        on a PC whose sshd answers in PowerShell must not make the console send it sh commands."""
        facts = self.facts or {}
        if facts.get("platform") in ("linux", "macos", "windows"):
            return facts["platform"]
        if self.platform_hint and self.platform_hint != "auto":
            return self.platform_hint
        text = " ".join(str(facts.get(key, "")) for key in ("platform", "os", "system", "os_name")).lower()
        if "darwin" in text or "mac" in text:
            return "macos"
        if "windows" in text:
            return "windows"
        return "linux"

    @property
    def tunnel_refusal(self) -> str:
        """Why a deployment cannot reach this node's rpc-server through an SSH tunnel, or "" when it can.

        A Windows PC: the tunnel's key, allowed one forward to 127.0.0.1:<port> from the coordinator only,
        goes into the worker's authorized_keys through POSIX commands (deployments/steps/rpc_tunnel.py),
        and Windows' OpenSSH reads an administrator's keys from
        C:\\ProgramData\\ssh\\administrators_authorized_keys, which must keep an ACL of Administrators and
        SYSTEM only: the console writes neither yet."""
        if not self.rpc_tunnel:
            return f"{self.name} does not allow RPC tunnels (a node setting): choose direct mode."
        if self.platform == "windows":
            return (
                f"{self.name} runs Windows, where the console cannot set up the RPC tunnel yet: the tunnel's "
                "key (allowed one forward, from the coordinator only) must go into the PC's authorized_keys "
                "(administrators_authorized_keys for an administrator, with its strict ACL), which the "
                "console writes on Linux and macOS only. Choose direct mode: Windows Firewall then admits "
                "only the coordinator."
            )
        if self.is_local:
            return f"{self.name} is the console's own host, not reached over SSH: choose direct mode."
        return ""

    @property
    def platform_label(self) -> str:
        """The platform the console uses for the node, and the operator's setting where they differ."""
        found = {"linux": "Linux", "macos": "macOS", "windows": "Windows"}.get(self.platform, self.platform)
        hint = self.platform_hint
        if not hint or hint == "auto" or hint == self.platform:
            return found
        return f"{found} (as its SSH server answered; the setting says {self.get_platform_hint_display()})"

    @property
    def rpc_endpoint_host(self) -> str:
        """Where a coordinator connects to its ggml-rpc-server (a wildcard bind is reached by address)."""
        return self.address if self.rpc_binds_everywhere else (self.rpc_bind_address or self.address)

    @property
    def rpc_bind_host(self) -> str:
        """ggml-rpc-server's -H: the bind address an admin set, else the node's own address."""
        return self.rpc_bind_address or self.address

    @property
    def rpc_binds_everywhere(self) -> bool:
        """An admin let ggml-rpc-server listen on every interface: it has no authentication, so say so."""

        return binds_everywhere(self.rpc_bind_address)

    @property
    def wsl_windows_side(self) -> WindowsSide | None:
        """When the last probe found WSL: the port forward and firewall lines its Windows side needs, built
        with this node's ports (nodes/probe/wsl.py). None on any other node."""
        return windows_side((self.facts or {}).get("wsl"), rpc_port=self.rpc_port, ssh_port=self.ssh_port)

    @property
    def is_local(self) -> bool:
        return self.transport == Transport.LOCAL

    @property
    def current_build(self) -> Build | None:
        """The newest llama.cpp build on this node, the one deployments use."""
        return self.builds.order_by("-created_at", "-pk").first()

    @property
    def detected_install_dir(self) -> str:
        """The folder of the llama.cpp install the last probe found (ggml-rpc-server and llama-server side
        by side, as a build of it needs), or ""."""
        facts = self.facts or {}
        rpc, server = facts.get("rpc_server_binary") or "", facts.get("llama_server_binary") or ""
        paths = ntpath if self.platform == "windows" else posixpath
        if not paths.isabs(rpc) or not paths.isabs(server) or (paths is ntpath and rpc[1:2] != ":"):
            return ""
        folder = paths.dirname(server)
        return folder if paths.dirname(rpc) == folder else ""

    @property
    def detected_install_unrecorded(self) -> bool:
        """The probe found an install that no build of this node records yet."""
        folder = self.detected_install_dir
        if not folder:
            return False
        if self.platform == "windows":
            server = ntpath.join(folder, "llama-server.exe")
        else:
            server = posixpath.join(folder, "llama-server")
        return not self.builds.filter(llama_server_path=server).exists()

    @property
    def hardware_is_fresh(self) -> bool:
        if not self.last_seen_at:
            return False
        age = (timezone.now() - self.last_seen_at).total_seconds()
        return age <= max(3 * settings.RAMDECK_PROBE_INTERVAL_S, 3600)

    # State changes. Each is one UPDATE so a worker and a web request never overwrite each other's fields.

    def record_offered_host_key(
        self, offered_key: str, fingerprint: str, *, changed: bool, message: str
    ) -> None:
        """A key no admin approved was offered: keep it for review; nothing runs until it is approved."""
        message = printable(message, LAST_ERROR_LIMIT, lines=True)
        self.pending_host_key, self.pending_host_key_fingerprint = offered_key, fingerprint
        self.reachability = Reachability.HOST_KEY_CHANGED if changed else Reachability.HOST_KEY_PENDING
        self.last_error = message
        Node.objects.filter(pk=self.pk).update(
            pending_host_key=offered_key,
            pending_host_key_fingerprint=fingerprint,
            reachability=self.reachability,
            last_error=message,
        )

    def mark_unreachable(self, message: str, *, probed: bool = False) -> bool:
        """The console could not reach the node. The first time (it answered before) also records since
        when and writes one audit entry; later failures only keep the reason current. `probed`: this was
        a probe's attempt (its time counts for the backoff). Returns whether it went offline now."""
        message = printable(message, LAST_ERROR_LIMIT, lines=True)  # it may quote the node's SSH server
        now = timezone.now()
        fields = {"reachability": Reachability.UNREACHABLE, "last_error": message}
        if probed:
            fields["last_probe_at"] = now
        went_offline = bool(
            Node.objects.filter(pk=self.pk, unreachable_since__isnull=True).update(unreachable_since=now)
        )
        Node.objects.filter(pk=self.pk).update(**fields)
        for name, value in fields.items():
            setattr(self, name, value)
        if went_offline:
            self.unreachable_since = now
            node = Node.objects.only("name", "last_seen_at").get(pk=self.pk)
            seen = node.last_seen_at.isoformat() if node.last_seen_at else None
            changes = {"reason": message[:300], "last_seen": seen}
            history.record(None, "node.offline", node, changes=changes, actor_name="console")
        return went_offline

    def mark_back_online(self) -> None:
        """It answered again after being offline: the one audit entry of its return (the probe stores the
        rest). Called by the successful probe, under its lock on the row."""
        since = Node.objects.filter(pk=self.pk).values_list("unreachable_since", flat=True).first()
        if since is None:
            return
        Node.objects.filter(pk=self.pk).update(unreachable_since=None)
        self.unreachable_since = None
        away = timesince(since, timezone.now())
        changes = {"offline_since": since.isoformat(), "offline_for": away}
        history.record(None, "node.online", self, changes=changes, actor_name="console")

    @property
    def offline_sentence(self) -> str:
        """The dashboard's line about an offline node: "pc2 offline since 21:40, last seen 3 hours ago"."""
        if self.unreachable_since is None:
            return ""
        since = timezone.localtime(self.unreachable_since)
        today = timezone.localtime(timezone.now()).date()
        when = f"{since:%H:%M}" if since.date() == today else f"{since:%Y-%m-%d %H:%M}"
        seen = f"last seen {timesince(self.last_seen_at)} ago" if self.last_seen_at else "never seen"
        return f"{self.name} offline since {when}, {seen}"

    def next_probe_at(self):
        """When the periodic probe may look at an offline node again (None: at every round, as any node
        that answers). The wait doubles with the outage, from the probe interval up to
        RAMDECK_PROBE_BACKOFF_MAX_S: a machine switched off for the night is looked at a dozen times, not
        a hundred."""
        if self.unreachable_since is None or self.last_probe_at is None:
            return None
        base = settings.RAMDECK_PROBE_INTERVAL_S
        away = max(0.0, (self.last_probe_at - self.unreachable_since).total_seconds())
        wait = min(max(base, away), max(base, settings.RAMDECK_PROBE_BACKOFF_MAX_S))
        return self.last_probe_at + timedelta(seconds=wait)

    def approve_pending_host_key(self, seen_fingerprint: str, by) -> bool:
        """Pin the pending key, but only if it is still the one the admin saw (the fingerprint they were
        shown travels with the form): a key that changed again after the page rendered is never approved
        unseen. Returns whether the key was approved."""
        if not self.pending_host_key or seen_fingerprint != self.pending_host_key_fingerprint:
            return False
        now = timezone.now()
        approved = Node.objects.filter(
            pk=self.pk, pending_host_key=self.pending_host_key, pending_host_key_fingerprint=seen_fingerprint
        ).update(
            host_key=self.pending_host_key,
            host_key_fingerprint=seen_fingerprint,
            pending_host_key="",
            pending_host_key_fingerprint="",
            host_key_approved_at=now,
            host_key_approved_by=by,
            reachability=Reachability.UNKNOWN,
            last_error="",
        )
        if approved:
            self.refresh_from_db()
        return bool(approved)


class DeviceKind(models.TextChoices):
    CPU = "cpu", "CPU"
    CUDA = "cuda", "NVIDIA CUDA"
    METAL = "metal", "Apple Metal"
    ROCM = "rocm", "AMD ROCm"
    VULKAN = "vulkan", "Vulkan"


class Device(models.Model):
    """A llama.cpp device on a node, named as llama.cpp names it (CUDA0, MTL0, CPU, ...)."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="devices")
    name = models.CharField(max_length=40)
    kind = models.CharField(max_length=10, choices=DeviceKind.choices)
    description = models.CharField(max_length=200, blank=True)
    total_bytes = models.BigIntegerField()
    free_bytes = models.BigIntegerField()
    # Unified memory (Apple Silicon): total and free are the Mac's raw memory; the planner decides the
    # usable share from the clamp and this limit.
    unified_memory = models.BooleanField(default=False)
    wired_limit_bytes = models.BigIntegerField(
        null=True,
        blank=True,
        help_text="Metal's wired limit when an operator set one (sysctl iogpu.wired_limit_mb); "
        "empty: macOS's default.",
    )
    bandwidth_gbs = models.FloatField(null=True, blank=True, help_text="From the table of known chips.")
    bandwidth_override_gbs = models.FloatField(
        null=True, blank=True, help_text="Set by an operator; wins over the table and measurements."
    )
    measured_bandwidth_gbs = models.FloatField(
        null=True, blank=True, help_text="Bytes of weights read per second of decode through its rpc-server."
    )
    measured_local_bandwidth_gbs = models.FloatField(
        null=True, blank=True, help_text="The CPU inside llama-server itself (when this node coordinates)."
    )
    measured_prompt_gflops = models.FloatField(
        null=True,
        blank=True,
        help_text="Prompt throughput: GFLOP/s of prompt processing at a 512-token ubatch (issue 20).",
    )
    measured_overhead_ms = models.FloatField(
        null=True, blank=True, help_text="Fixed per-token cost of a pass through its rpc-server (loopback)."
    )
    measured_at = models.DateTimeField(null=True, blank=True)
    # The hardware the figure was measured on (see `hardware_signature`): a probe that finds other hardware
    # makes the figure stale.
    measured_signature = models.CharField(max_length=400, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["node__name", "name"]
        constraints = [models.UniqueConstraint(fields=["node", "name"], name="unique_device_per_node")]

    def __str__(self) -> str:
        return f"{self.node.name}/{self.name}"

    @property
    def hardware_signature(self) -> str:
        """What the probe says this device is. A CPU's figure also depends on the cores the node may use,
        its CPU quota and its RAM (other modules may mean other memory channels), so those are part of it;
        a memory limit on the node is not (it changes what fits, not how fast it runs)."""
        if self.kind != DeviceKind.CPU:
            return f"{self.kind}|{self.description}|{self.total_bytes}"[:400]
        facts = self.node.facts or {}
        ram = facts.get("ram_physical_bytes") or facts.get("ram_total_bytes", "")
        parts = [self.kind, self.description, f"ram={ram}"]
        parts += [f"cores={facts.get('cpu_cores', '')}", f"quota={facts.get('cpu_quota_cores', '')}"]
        return "|".join(str(part) for part in parts)[:400]

    @property
    def measurement_state(self) -> str:
        """ "none", "fresh", "old" (older than RAMDECK_CALIBRATION_MAX_AGE_DAYS: still used, but re-calibrate)
        or "hardware_changed" (the probe found other hardware since: not used)."""
        if self.measured_bandwidth_gbs is None or self.measured_at is None:
            return "none"
        if self.measured_signature and self.measured_signature != self.hardware_signature:
            return "hardware_changed"
        age_days = (timezone.now() - self.measured_at).total_seconds() / 86400
        return "old" if age_days > settings.RAMDECK_CALIBRATION_MAX_AGE_DAYS else "fresh"

    @property
    def measurement_is_stale(self) -> bool:
        return self.measurement_state in ("old", "hardware_changed")

    @property
    def usable_measured_bandwidth_gbs(self) -> float | None:
        """The measured figure unless the hardware changed since it was taken."""
        return self.measured_bandwidth_gbs if self.measurement_state in ("fresh", "old") else None

    @property
    def effective_bandwidth_gbs(self) -> float | None:
        """What the planner uses: an operator's figure, else a measurement of this hardware, else the
        table's."""
        return self.bandwidth_override_gbs or self.usable_measured_bandwidth_gbs or self.bandwidth_gbs

    @property
    def bandwidth_source(self) -> str:
        if self.bandwidth_override_gbs:
            return "operator"
        if self.usable_measured_bandwidth_gbs:
            return "measured"
        return "table" if self.bandwidth_gbs else "unknown"

    def record_measurement(self, *, bandwidth_gbs: float | None, overhead_ms: float | None, **extra) -> None:
        """Store a calibration's figures for this device, stamped with now and the hardware it ran on."""
        self.measured_bandwidth_gbs = bandwidth_gbs
        self.measured_overhead_ms = overhead_ms
        self.measured_local_bandwidth_gbs = extra.get("local_bandwidth_gbs")
        self.measured_prompt_gflops = extra.get("prompt_gflops")
        self.measured_at = timezone.now()
        self.measured_signature = self.hardware_signature
        self.save(
            update_fields=[
                "measured_bandwidth_gbs",
                "measured_overhead_ms",
                "measured_local_bandwidth_gbs",
                "measured_prompt_gflops",
                "measured_at",
                "measured_signature",
                "updated_at",
            ]
        )

    @property
    def used_fraction(self) -> float:
        if not self.total_bytes:
            return 0.0
        return max(0.0, min(1.0, 1 - self.free_bytes / self.total_bytes))
