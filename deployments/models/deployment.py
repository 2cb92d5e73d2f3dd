"""GGUF model files and deployments (a confirmed plan and everything that happened to it since)."""

from __future__ import annotations

from django.conf import settings
from django.db import IntegrityError, models, transaction
from django.urls import reverse
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from deployments import live
from deployments.models.claims import ClaimConflict, ResourceClaim
from modelfiles.models import ModelCopy, ModelFile
from nodes.models import Node
from planning import first_word
from planning.speed_check import SPEED_ERROR_LIMIT, miss_causes
from ramdeck_site import crypto
from remote.text import printable, printable_json


class DeploymentState(models.TextChoices):
    """The life of a deployment.

        confirmed ──deploy──► preparing ──► launching ──► verifying ──► running ──stop──► stopping ──► stopped
                                  │             │             │            │   ▲              │
                                  └─────────────┴──────┬──────┘            ▼   │ (recovers)   │
                                                       ▼                degraded ──stop───────┘
                                                     failed (step and reason kept; what it started is ended)

    preparing: reap stale processes and check builds; launching: rpc-servers, then llama-server;
    verifying: compare llama.cpp's logged placement with the plan and measure speed. A stopped or failed
    deployment can be redeployed: stopped/failed ──redeploy──► preparing, a new deploy run of the same
    deployment. A confirmed, stopped or failed one can be deleted. With self-healing on,
    degraded ──heal──► launching (its processes stopped and started again, then verified); a heal that
    does not succeed goes back to degraded, and the last allowed one to failed. Stopping is possible
    from every active state.
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
# What may be deployed again (a new run of the same deployment) or deleted, besides a confirmed one.
REDEPLOYABLE_STATES = TERMINAL_STATES


# The causes of a missed prediction that calibrating the node again addresses.
RECALIBRATE_KINDS = ("calibration", "link")


class RpcMode(models.TextChoices):
    """How the coordinator reaches the workers' ggml-rpc-server (llamacpp/rpc_guard.py)."""

    AUTO = "auto", "Tunnel when every worker allows it, else direct"
    TUNNEL = "tunnel", "SSH tunnel (rpc-server listens on 127.0.0.1 only)"
    DIRECT = "direct", "Direct on the LAN (faster; firewalled where the SSH user may)"


class Deployment(models.Model):
    name = models.CharField(max_length=200)
    model_file = models.ForeignKey(ModelFile, on_delete=models.PROTECT, related_name="deployments")
    coordinator = models.ForeignKey(
        "nodes.Node", on_delete=models.PROTECT, related_name="coordinated_deployments"
    )
    # The immutable plan snapshot (planning/planner.py output) and the settings it was planned with.
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
    # Opt-in: when the monitor finds it degraded, restart what is missing (reap, start, verify again), with
    # backoff and a limit (deployments/lifecycle/healing.py). The attempts count restarts once it runs again.
    self_heal = models.BooleanField(default=False)
    heal_attempts = models.PositiveSmallIntegerField(default=0)
    last_heal_at = models.DateTimeField(null=True, blank=True)
    # The plan page's one-time token: the same confirm posted twice (a double click, a resent form) finds
    # the deployment it already made instead of making a second one.
    confirm_token = models.CharField(max_length=64, null=True, blank=True, unique=True, editable=False)
    # The operator set the layers (and experts) per device on the plan page instead of taking the planner's
    # split (planning/manual.py); the plan snapshot is that split's.
    placed_by_hand = models.BooleanField(default=False)
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
    # The plan's prediction, stored beside the measurement when the measure step ran.
    predicted_decode_tps = models.FloatField(null=True, blank=True)
    # The context llama.cpp really gave the slots, all slots together (llama.cpp rounds -c to 256 and caps
    # each slot at the model's trained context), read from llama-server's log by the verify step; the
    # numbers it came from are verification["context"].
    ctx_used = models.PositiveIntegerField(null=True, blank=True)
    # How many times llama-server loaded this deployment's model to its health answer, over all its runs (not
    # cleared by a redeploy): from the second on, its workers' RPC caches hold the large tensors (a warm load,
    # planning/first_word.py).
    loads = models.PositiveIntegerField(default=0)
    # When the console's chat box first got an answer from it (the first-run checklist's last tick). Only the
    # time: the conversation itself is never stored.
    chat_answered_at = models.DateTimeField(null=True, blank=True)
    processes = models.JSONField(default=dict, blank=True)
    rpc_mode = models.CharField(max_length=10, choices=RpcMode.choices, default=RpcMode.AUTO)
    # What a launch changed on a node besides processes, undone by the stop steps: an authorized_keys entry
    # for a tunnel, a firewall rule for a direct rpc-server. {key: {"node", "kind", ...}}.
    guards = models.JSONField(default=dict, blank=True)
    # What the monitor saw last (deployments/monitor.py): {"checked_at", "processes": [per-process status:
    # alive, pid, uptime, memory], "metrics": llama-server's /metrics numbers}. Pages only read it.
    live_status = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]

    def __str__(self) -> str:
        return f"{self.name} (#{self.pk})"

    def get_absolute_url(self) -> str:
        return reverse("deployments:detail", args=[self.pk])

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES

    @property
    def speed_error(self) -> float | None:
        """(measured - predicted) / predicted decode speed: -0.5 is half as fast as predicted."""
        predicted = self.predicted_decode_tps or (self.plan or {}).get("predicted_tokens_per_s")
        if not self.measured_decode_tps or not predicted:
            return None
        return (self.measured_decode_tps - predicted) / predicted

    @property
    def speed_is_off(self) -> bool:
        error = self.speed_error
        return error is not None and abs(error) > SPEED_ERROR_LIMIT

    def recalibration_advice(self) -> list[str]:
        """Which nodes to calibrate again when the measured speed is far from the prediction: those whose
        figures the miss points at (not a machine that was busy, nor a prediction at another context)."""
        return [row["node"] for row in self.speed_miss_reasons() if row["kind"] in RECALIBRATE_KINDS]

    @property
    def speed_check(self) -> dict:
        """What the measure step stored about its measurement (verification["speed"]): samples, the context
        it filled, the prediction there, the node's CPU use while it decoded."""
        return (self.verification or {}).get("speed") or {}

    @property
    def first_word_check(self) -> dict:
        """The measure step's first token and load against the plan's (verification["first_word"]), with
        `ttft_off` / `load_off` when either misses by more than planning.first_word.ERROR_LIMIT."""
        check = dict((self.verification or {}).get("first_word") or {})
        if check:
            check["ttft_off"] = first_word.is_off(check.get("ttft_error"))
            check["load_off"] = first_word.is_off(check.get("load_error"))
        return check

    def speed_miss_reasons(self) -> list[dict[str, str]]:
        """Why the measured speed is far from the prediction, likeliest first: [{"node", "kind", "reason"}].

        What the measurement itself showed first (planning/speed_check.py: the coordinator was busy while it
        decoded, the prediction was priced at a context the run did not fill), then the nodes of the plan
        whose figures are not measurements of their present hardware (never calibrated, hardware changed, a
        device missing, stale), the nodes whose link is slower now than when it was calibrated; only when
        none of those shows, the node the prediction leaned on most (the largest share of its time)."""
        if not self.speed_is_off:
            return []

        share: dict[str, float] = {}
        for item in (self.plan or {}).get("placements", []):
            if item.get("layers") or item.get("output_layer"):
                share[item["node"]] = share.get(item["node"], 0.0) + float(item.get("ms_per_token") or 0)
        share.setdefault(self.coordinator.name, 0.0)
        nodes = sorted(Node.objects.filter(name__in=share).prefetch_related("devices"), key=lambda n: n.name)
        figures = [{"node": n.name, "reason": reason} for n in nodes if (reason := _figures_problem(n))]
        links = [
            {"node": n.name, "reason": reason}
            for n in nodes
            if n.pk != self.coordinator_id and (reason := _slow_link(n))
        ]
        check = {**self.speed_check, "error": self.speed_error}
        causes = miss_causes(check, coordinator=self.coordinator.name, figures=figures, links=links)
        if causes or not share:
            return causes
        name = max(share, key=lambda node: share[node])
        total = sum(share.values())
        weight = f" ({share[name] / total:.0%} of the predicted time per token)" if total else ""
        return [
            {
                "node": name,
                "kind": "calibration",
                "reason": f"its figures are fresh, but the prediction leans on them most{weight}",
            }
        ]

    @property
    def ctx_requested(self) -> int | None:
        return (self.plan_settings or {}).get("ctx") or ((self.plan or {}).get("settings") or {}).get("ctx")

    @property
    def ctx_differs(self) -> bool:
        requested = self.ctx_requested
        return self.ctx_used is not None and requested is not None and self.ctx_used != requested

    def ctx_note(self) -> str:
        """Why llama.cpp's context is not the one asked for ("" when it is, or is not known yet)."""
        if not self.ctx_differs:
            return ""
        context = (self.verification or {}).get("context") or {}
        if context.get("capped") and context.get("n_ctx_train"):
            return f"llama.cpp capped each slot at the model's trained context ({context['n_ctx_train']:,})"
        if context.get("n_ctx") and context["n_ctx"] != self.ctx_requested:
            return "llama.cpp rounds the context to a multiple of 256 (and of the slot count)"
        return "as llama-server reported it at start"

    def set_api_key(self, key: str) -> None:
        self.api_key_encrypted = crypto.encrypt(key)

    def api_key(self) -> str:
        return crypto.decrypt(self.api_key_encrypted)

    # State changes. Each is a conditional UPDATE from the states it may leave, so pressing a button
    # twice, a redelivered task or a racing monitor cannot move a deployment backwards; each returns
    # whether it changed anything.

    def _transition(self, from_states, to_state: str, **fields) -> bool:
        fields = _reported(fields)
        changed = Deployment.objects.filter(pk=self.pk, state__in=list(from_states)).update(
            state=to_state, **fields
        )
        if changed:
            self.state = to_state
            for name, value in fields.items():
                setattr(self, name, value)
            live.changed(self.pk)
        return bool(changed)

    def mark_preparing(self) -> bool:
        """confirmed → preparing, claiming the plan's ports and devices in the same transaction.

        Raises ClaimConflict (and changes nothing) when another active deployment holds one of them.
        """
        return self._to_preparing([DeploymentState.CONFIRMED])

    def mark_redeploying(self) -> bool:
        """stopped or failed → preparing, for a new deploy run of this same deployment (Redeploy, Restart):
        what the last run found (its processes, verification, measured speed, reason) is cleared, since that
        run's processes were ended by its stop or rollback. Claims as mark_preparing does."""
        return self._to_preparing(
            REDEPLOYABLE_STATES,
            state_reason="",
            failed_step="",
            verification={},
            measured_decode_tps=None,
            measured_prompt_tps=None,
            predicted_decode_tps=None,
            ctx_used=None,
            processes={},
            live_status={},
            running_at=None,
            stopped_at=None,
            heal_attempts=0,
            last_heal_at=None,
        )

    def _to_preparing(self, from_states, **fields) -> bool:
        before = {name: getattr(self, name) for name in ("state", "started_at", *fields)}
        with transaction.atomic():
            if not self._transition(
                from_states, DeploymentState.PREPARING, started_at=timezone.now(), **fields
            ):
                return False
            try:
                with transaction.atomic():
                    ResourceClaim.claim_for(self)
            except IntegrityError:
                # Undo the in-memory state too; the outer transaction is rolled back by the raise.
                for name, value in before.items():
                    setattr(self, name, value)
                raise ClaimConflict(ResourceClaim.describe_conflicts(self)) from None
        return True

    def mark_launching(self) -> bool:
        return self._transition([DeploymentState.PREPARING], DeploymentState.LAUNCHING)

    def mark_verifying(self) -> bool:
        return self._transition([DeploymentState.LAUNCHING], DeploymentState.VERIFYING)

    def mark_running(self) -> bool:
        return self._transition(
            [DeploymentState.VERIFYING],
            DeploymentState.RUNNING,
            running_at=timezone.now(),
            state_reason="",
            heal_attempts=0,
        )

    def mark_healing(self) -> bool:
        """degraded → launching, for a self-healing attempt (counted)."""
        attempts = self.heal_attempts + 1
        return self._transition(
            [DeploymentState.DEGRADED],
            DeploymentState.LAUNCHING,
            heal_attempts=attempts,
            last_heal_at=timezone.now(),
        )

    def mark_heal_failed(self, reason: str) -> bool:
        """A self-healing attempt that did not bring it back: degraded again, with why."""
        mid = [DeploymentState.LAUNCHING, DeploymentState.VERIFYING]
        return self._transition(mid, DeploymentState.DEGRADED, state_reason=reason)

    def mark_degraded(self, reason: str) -> bool:
        return self._transition([DeploymentState.RUNNING], DeploymentState.DEGRADED, state_reason=reason)

    def mark_recovered(self) -> bool:
        return self._transition([DeploymentState.DEGRADED], DeploymentState.RUNNING, state_reason="")

    def mark_stopping(self, reason: str = "") -> bool:
        movable = [s for s in ACTIVE_STATES if s != DeploymentState.STOPPING]
        return self._transition(movable, DeploymentState.STOPPING, state_reason=reason)

    def mark_stopped(self) -> bool:
        with transaction.atomic():
            changed = self._transition(
                [DeploymentState.STOPPING], DeploymentState.STOPPED, stopped_at=timezone.now()
            )
            if changed:
                self.claims.all().delete()
        return changed

    def fail(self, step: str, reason: str) -> bool:
        """Any active state (or confirmed, when the refusal comes before preparing) → failed."""
        with transaction.atomic():
            changed = self._transition(
                [DeploymentState.CONFIRMED, *ACTIVE_STATES],
                DeploymentState.FAILED,
                failed_step=step,
                state_reason=reason,
                stopped_at=timezone.now(),
            )
            if changed:
                self.claims.all().delete()
        return changed

    def record(self, **fields) -> None:
        """Save non-state fields (verification, measured speed, processes) without touching the state."""
        fields = _reported(fields)
        for name, value in fields.items():
            setattr(self, name, value)
        Deployment.objects.filter(pk=self.pk).update(**fields)
        live.changed(self.pk)

    def count_load(self) -> None:
        """One more load of the model reached llama-server's health answer."""
        Deployment.objects.filter(pk=self.pk).update(loads=models.F("loads") + 1)
        self.refresh_from_db(fields=["loads"])

    def workers(self) -> set[str]:
        """The nodes whose rpc-servers the plan uses."""
        return {p["node"] for p in (self.plan or {}).get("placements", []) if p.get("endpoint")}

    def load_kind(self) -> str:
        """ "warm" when this load's workers received this model before (this deployment loaded it already,
        or another one of the same model on the same workers did: their RPC caches hold its large tensors),
        or each holds a registered copy of it (its cache is filled from the copy, modelfiles/cache_fill.py),
        else "cold". A cache cleared since is not seen."""
        if self.loads > 1:
            return "warm"
        workers = self.workers()
        copies = ModelCopy.objects.filter(model_id=self.model_file_id).values_list("node__name", flat=True)
        copies = set(copies)
        if workers and workers <= copies:
            return "warm"
        others = Deployment.objects.filter(model_file_id=self.model_file_id, loads__gt=0).exclude(pk=self.pk)
        return "warm" if workers and any(workers <= other.workers() for other in others) else "cold"

    def add_process(self, key: str, info: dict) -> None:
        """Record a process this deployment started (by PID), keeping those other steps recorded: the row
        is re-read under a lock, since the copy in hand may be older than the database's."""
        with transaction.atomic():
            current = Deployment.objects.select_for_update().only("processes").get(pk=self.pk)
            self.processes = {**(current.processes or {}), key: info}
            Deployment.objects.filter(pk=self.pk).update(processes=self.processes)
        live.changed(self.pk)

    def add_guard(self, key: str, info: dict) -> None:
        """Record an authorized key or a firewall rule this deployment installed (see add_process)."""
        with transaction.atomic():
            current = Deployment.objects.select_for_update().only("guards").get(pk=self.pk)
            self.guards = {**(current.guards or {}), key: info}
            Deployment.objects.filter(pk=self.pk).update(guards=self.guards)

    def store_api_key(self, key: str) -> None:
        self.set_api_key(key)
        self.save(update_fields=["api_key_encrypted"])

    def record_live_status(self, status: dict) -> bool:
        """Store the monitor's look, unless the deployment left running and degraded while it looked (a
        stop that ended its processes meanwhile has said so itself). Returns whether it was stored."""
        fields = _reported({"live_status": status})
        watched = [DeploymentState.RUNNING, DeploymentState.DEGRADED]
        if not Deployment.objects.filter(pk=self.pk, state__in=watched).update(**fields):
            return False
        self.live_status = fields["live_status"]
        live.changed(self.pk)
        return True

    def record_process_outcome(self, node: str, pid: int, *, alive: bool, note: str) -> None:
        """What a stop step saw of one of the deployment's processes (it ended it, found it gone, or could
        not end it): the status the pages show is corrected now, not at the monitor's next look (which
        never comes for a deployment that stopped). Read and written under a lock, as add_process."""
        with transaction.atomic():
            current = Deployment.objects.select_for_update().only("live_status", "processes").get(pk=self.pk)
            status = dict(current.live_status or {})
            rows = status.get("processes")
            if rows is None:
                rows = [{**info, "alive": None} for info in (current.processes or {}).values()]
            now = timezone.now().isoformat()
            for row in rows:
                if row.get("node") == node and int(row.get("pid") or 0) == int(pid):
                    # Uptime and memory were true of a process that is no more.
                    for stale in ("uptime_s", "rss_bytes", "error"):
                        row.pop(stale, None)
                    row.update(alive=alive, outcome=note, outcome_at=now)
            status["processes"] = rows
            self.live_status = _reported({"live_status": status})["live_status"]
            Deployment.objects.filter(pk=self.pk).update(live_status=self.live_status)
        live.changed(self.pk)

    def process_rows(self) -> list[dict]:
        """The processes table: the monitor's last look (or the stop steps' word on each process), else the
        processes as recorded, not checked yet. A process the monitor last saw alive before the deployment
        ended is not shown alive: nobody has looked since, and the stop ended it or tried to."""
        status = self.live_status or {}
        rows = status.get("processes")
        if rows is None or not status.get("checked_at") and not any(r.get("outcome") for r in rows):
            rows = [{**info, "alive": None} for info in (self.processes or {}).values()]
        rows = [dict(row) for row in rows]
        if self.state in TERMINAL_STATES:
            for row in rows:
                if row.get("alive") and not row.get("outcome"):
                    row.update(alive=None, uptime_s=None, rss_bytes=None)
                    row["outcome"] = "not checked since the deployment ended"
        return sorted(rows, key=lambda r: (r["role"] != "llama-server", r["node"]))

    def gone_processes(self) -> list[dict]:
        """The processes the monitor found ended (not those on a node it could not reach)."""
        rows = (self.live_status or {}).get("processes") or []
        return [row for row in rows if row.get("alive") is False and not row.get("error")]

    @property
    def serving(self) -> bool:
        """Whether llama-server may answer: running, or degraded with llama-server not known to be gone."""
        if self.state == DeploymentState.RUNNING:
            return True
        if self.state != DeploymentState.DEGRADED:
            return False
        return not any(row.get("role") == "llama-server" for row in self.gone_processes())

    def trouble(self) -> str:
        """What went wrong with a degraded deployment, as one sentence a person reads."""
        rows = (self.live_status or {}).get("processes") or []
        gone = [f"{row['role']} on {row['node']}" for row in self.gone_processes()]
        unreachable = sorted({row["node"] for row in rows if row.get("error")})
        parts = []
        if gone:
            parts.append(f"{_joined(gone)} stopped running")
        if unreachable:
            parts.append(f"{_joined(unreachable)} cannot be reached")
        if parts:
            text = " and ".join(parts)
        else:
            first = (self.state_reason or "").strip().splitlines()
            text = first[0].rstrip(".") if first else "it stopped answering"
        since = (self.live_status or {}).get("down_since")
        when = ""
        if since and (moment := parse_datetime(since)):
            when = f" (noticed at {timezone.localtime(moment):%H:%M})"
        return f"{self.name} is not working: {text}{when}."


# Fields that hold what llama.cpp, its logs, /metrics or a node said (a reason quotes an error, the
# verification quotes the log, the live status the monitor's look at the processes): printable only, as
# every string a node reports (remote/text.py). The reason keeps its line breaks.
STATE_REASON_LIMIT = 4000


_REPORTED_JSON = ("verification", "live_status")


def _reported(fields: dict) -> dict:
    cleaned = dict(fields)
    if isinstance(cleaned.get("state_reason"), str):
        cleaned["state_reason"] = printable(cleaned["state_reason"], STATE_REASON_LIMIT, lines=True)
    for name in _REPORTED_JSON:
        if name in cleaned:
            cleaned[name] = printable_json(cleaned[name], lines=True)
    return cleaned


def _joined(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _figures_problem(node) -> str:
    """What is wrong with the figures the planner had for this node ("" when they are fresh measurements)."""
    if node.calibrated_at is None:
        return "never calibrated: the plan used table figures for it"
    states = {d.name: d.measurement_state for d in node.devices.all()}
    changed = sorted(name for name, state in states.items() if state == "hardware_changed")
    if changed:
        names = ", ".join(changed)
        return f"its hardware changed since it was calibrated ({names}): the plan used table figures"
    missing = sorted(name for name, state in states.items() if state == "none")
    if missing:
        return f"{', '.join(missing)} not calibrated: the plan used table figures for it"
    old = sorted(name for name, state in states.items() if state == "old")
    if old:
        days = settings.RAMDECK_CALIBRATION_MAX_AGE_DAYS
        return f"its calibration is stale (older than {days:g} days)"
    return ""


# A worker's round trip counts as slower than calibrated beyond twice the calibrated one, and 1 ms more.
SLOW_LINK_FACTOR = 2.0


SLOW_LINK_MIN_MS = 1.0


def _slow_link(node) -> str:
    """The node's link is slower now (its last probe's round trip) than when it was calibrated."""
    then, now = node.link_rtt_ms, node.rtt_ms
    if then is None or now is None:
        return ""
    if now > SLOW_LINK_FACTOR * then and now - then > SLOW_LINK_MIN_MS:
        return f"its link is slow: a round trip takes {now:.1f} ms now, {then:.1f} ms when it was calibrated"
    return ""
