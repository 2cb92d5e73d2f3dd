"""A deployment's life as jobs: a `deploy` job whose steps (child jobs) are reap → rpc_server (→ rpc_tunnel) →
preflight → llama_server → verify → measure; an `undeploy` job whose steps are `stop` jobs, one per node.

`start_deploy` is what the Deploy button calls: it refuses with a reason (no build, RPC protocols differ, a
device the node's build does not offer, ports or devices held by another deployment), moves the deployment
to preparing (claims included, in one transaction), creates the run and every step as queued jobs so the
page shows the whole run at once, and enqueues the run on commit. `stop_deployment` (the Stop button) moves
the deployment to stopping, asks a deploy run still going to cancel, and enqueues an undeploy job on the
control queue, which waits for that run to end, then ends by PID what the deployment started. The bodies
of both runs are deployments/lifecycle/runs.py; the runner (jobs/runner.py) supervises them and their steps
alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from django.db import transaction

from audit.history import record
from builds.offers import plan_device_refusal
from calibration.store import CALIBRATE
from calibration.store import refusal as calibration_refusal
from deployments import live
from deployments.models import (
    REDEPLOYABLE_STATES,
    ClaimConflict,
    Deployment,
    DeploymentState,
    DeploymentStep,
    RpcMode,
)
from jobs.models import ACTIVE_STATES as ACTIVE_JOB_STATES
from jobs.models import Job, JobState, may_use_local_node
from llamacpp import rpc_guard
from llamacpp.args import node_cpu_threads, quiet_rpc_server_args, rpc_server_args
from llamacpp.versions import protocol_mismatch
from nodes.guards import direct_bind, ipv4_of
from nodes.models import Node

logger = logging.getLogger(__name__)

MID_DEPLOY_STATES = (DeploymentState.PREPARING, DeploymentState.LAUNCHING, DeploymentState.VERIFYING)
# Job kinds of a deployment (registered in DeploymentsConfig.ready()): the two runs, and the kind of each
# step by its name on the deployment page.
DEPLOY, UNDEPLOY, HEAL = "deploy", "undeploy", "heal"
# One run that stops a running deployment, calibrates one of its nodes and deploys the same plan again
# (runs.py `recalibrate_body`): on the default queue, since a calibration takes minutes.
RECALIBRATE = "recalibrate"
# Runs that start processes (a Stop cancels them first).
LAUNCHING_RUNS = (DEPLOY, HEAL)
STEP_KINDS = {
    "reap": "reap",
    "rpc-server": "rpc_server",
    "rpc-tunnel": "rpc_tunnel",
    "preflight": "preflight",
    "llama-server": "llama_server",
    "verify": "verify",
    "measure": "measure",
    "stop": "stop",
    "rollback": "stop",
    "calibrate": "calibrate",
}
# A lost stop run is started again this many times at most; then the deployment fails, naming it.
MAX_UNDEPLOY_RUNS = 3


@dataclass
class Worker:
    node: Node
    port: int
    endpoint: str = ""  # where the plan's --rpc names it
    devices: list[str] = field(default_factory=list)
    needs: dict[str, int] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# What the plan asks for
# --------------------------------------------------------------------------------------------------


def workers_of(deployment: Deployment) -> list[Worker]:
    """The rpc-servers the plan needs, in --rpc order, with their devices and the bytes planned on each."""
    plan = deployment.plan or {}
    nodes = {
        n.name: n for n in Node.objects.filter(name__in={p.get("node") for p in plan.get("placements", [])})
    }
    explicit = {entry.get("node"): entry.get("args") for entry in plan.get("rpc_servers", [])}
    workers: dict[str, Worker] = {}
    for item in plan.get("placements", []):
        if not item.get("endpoint") or item.get("node") not in nodes:
            continue
        node = nodes[item["node"]]
        port = int(item["endpoint"].rsplit(":", 1)[1])
        worker = workers.setdefault(node.name, Worker(node, port, item["endpoint"]))
        if item.get("device") not in worker.devices:
            worker.devices.append(item["device"])
        needed = sum(int(item.get(k) or 0) for k in ("weights_bytes", "kv_bytes", "compute_bytes"))
        worker.needs[item["device"]] = worker.needs.get(item["device"], 0) + needed
    for worker in workers.values():
        args = list(explicit.get(worker.node.name) or rpc_server_args("", worker.port, worker.devices))
        # The plan names where to connect; the server binds where the node says (an admin may widen it).
        if "-H" in args:
            args[args.index("-H") + 1] = worker.node.rpc_bind_host
        else:
            args = ["-H", worker.node.rpc_bind_host, *args]
        # The tensor cache (-c) is the rpc_server step's to add, by the node's limit (llamacpp/rpc_cache.py).
        # As many threads as the node's physical cores (its own default is half its hardware threads).
        worker.args = quiet_rpc_server_args(args, node_cpu_threads(worker.node.facts))
    return list(workers.values())


def rpc_mode(deployment: Deployment, workers: list[Worker] | None = None) -> str:
    """ "tunnel" or "direct": the deployment's choice; "auto" is tunnel when every worker allows it."""
    if deployment.rpc_mode != RpcMode.AUTO:
        return deployment.rpc_mode
    workers = workers_of(deployment) if workers is None else workers
    tunnels = all(w.node.rpc_tunnel and w.node.platform != "windows" for w in workers)
    return RpcMode.TUNNEL if tunnels else RpcMode.DIRECT


def worker_bind(worker: Worker, mode: str, coordinator: Node) -> str:
    """Where a worker's rpc-server listens: loopback when only the coordinator reaches it (a tunnel, or the
    coordinator's own), else the node's direct bind (which may refuse: rpc_guard.BindRefused)."""
    if mode == RpcMode.TUNNEL or worker.node.pk == coordinator.pk:
        return "127.0.0.1"
    return direct_bind(worker.node)


def with_bind(args: list[str], bind: str) -> list[str]:
    args = list(args)
    args[args.index("-H") + 1] = bind
    return args


def rpc_refusal(deployment: Deployment, workers: list[Worker]) -> str:
    """Why the workers' rpc-servers cannot be reached the way the deployment says, or ""."""
    mode = rpc_mode(deployment, workers)
    for worker in workers:
        node = worker.node
        if node.pk == deployment.coordinator_id:
            continue
        if mode == RpcMode.DIRECT:
            try:
                direct_bind(node)
            except rpc_guard.BindRefused as exc:
                return f"{node.name}: {exc}"
            continue
        if reason := node.tunnel_refusal:
            return reason
    return ""


def refusal(deployment: Deployment) -> str:
    """Why this deployment cannot start now, or "" when it can."""
    plan = deployment.plan or {}
    if not plan.get("fits", True):
        return "The plan does not fit the devices; plan again."
    if not plan.get("llama_server_args"):
        return "The plan has no llama-server arguments."
    if deployment.model_file.node_id != deployment.coordinator_id:
        where = deployment.model_file.node
        return f"The model file is on {where}, not on the coordinator {deployment.coordinator}."
    if deployment.coordinator.platform == "windows":
        return (
            f"{deployment.coordinator.name} runs Windows, which can lend its memory as a worker but cannot "
            "coordinate yet: choose another coordinator."
        )
    workers = workers_of(deployment)
    if reason := rpc_refusal(deployment, workers):
        return reason
    nodes = [deployment.coordinator, *(w.node for w in workers)]
    protocols: dict[str, str] = {}
    for node in nodes:
        build = node.current_build
        if build is None:
            return f"{node.name} has no llama.cpp build: build or register one on its page first."
        protocols[node.name] = build.rpc_protocol
    return calibration_refusal_of(nodes) or protocol_mismatch(protocols) or plan_device_refusal(plan)


def calibration_refusal_of(nodes: list[Node]) -> str:
    """Why a deployment on `nodes` cannot start while a calibration runs on one of them, or "".

    A running calibration holds the node's RPC port and its cores (the first one starts by itself after a
    build): a deploy beside it would reap its rpc-server and both would measure nonsense. One still queued
    is no obstacle: it refuses to start on a node a deployment holds (calibration/store.py `refusal`). The
    check that counts runs again under the nodes' row locks (`lock_nodes`), as the calibration's does."""
    calibrating = (
        Job.objects.filter(kind=CALIBRATE, node__in=nodes, state=JobState.RUNNING)
        .select_related("node")
        .first()
    )
    if calibrating is not None:
        node, title = calibrating.node.name, calibrating.title
        return f"{node} is being calibrated ({title}): deploy once that job ends."
    return ""


def lock_nodes(nodes: list[Node]) -> list[Node]:
    """The nodes' rows locked until the transaction ends (SELECT ... FOR UPDATE, in primary-key order so two
    callers never wait on each other crosswise). A deploy that claims the nodes and a calibration that
    starts on one of them both check the other under this lock (calibration/store.py `locked_refusal`),
    so one of them always sees what the other did: they cannot both pass in the same instant."""
    return list(Node.objects.select_for_update().filter(pk__in={n.pk for n in nodes}).order_by("pk"))


class _Refused(Exception):
    pass


# --------------------------------------------------------------------------------------------------
# The runs and their steps
# --------------------------------------------------------------------------------------------------


def runs_of(deployment: Deployment, kind: str | None = None):
    """The deploy, heal, undeploy and recalibrate jobs of a deployment, newest first."""
    kinds = [kind] if kind else [DEPLOY, HEAL, UNDEPLOY, RECALIBRATE]
    return Job.objects.filter(kind__in=kinds, params__deployment=deployment.pk).order_by("-created_at", "-pk")


def active_run(deployment: Deployment, kind: str) -> Job | None:
    return runs_of(deployment, kind).filter(state__in=ACTIVE_JOB_STATES).first()


def deployment_nodes(deployment: Deployment) -> list[Node]:
    """The coordinator and every node the plan places something on."""
    names = {p.get("node") for p in (deployment.plan or {}).get("placements", [])}
    others = Node.objects.filter(name__in=names - {None}).exclude(pk=deployment.coordinator_id)
    return [deployment.coordinator, *others]


def local_refusal(deployment: Deployment, actor) -> str:
    """Why `actor` may not start or stop this deployment's jobs: one of its nodes is the console's own host
    and the actor is not an admin (jobs/models.py refuses those jobs anyway; this says it first)."""
    if not getattr(actor, "is_authenticated", False):
        return ""
    local = [n.name for n in deployment_nodes(deployment) if not may_use_local_node(actor, n)]
    if not local:
        return ""
    return (
        f"{', '.join(local)} is the console's own host: starting or stopping anything there needs the admin "
        "role, since it runs as the console's user beside its keys and database."
    )


def new_run(deployment: Deployment, kind: str, title: str, *, actor=None, **params) -> Job:
    """A run of the deployment, by `actor` (a person pressing a button) or, without one, by the console
    itself (a heal, a rollback): its jobs and their audit entries name no person who did not act."""
    created_by = actor if getattr(actor, "is_authenticated", False) else None
    return Job.objects.create(
        kind=kind,
        node=deployment.coordinator,
        title=title[:200],
        params={"deployment": deployment.pk, "notify": [live.group_name(deployment.pk)], **params},
        created_by=created_by,
    )


def add_step(
    deployment: Deployment, parent: Job, order: int, name: str, node: Node, title: str, **params
) -> Job:
    job = Job.objects.create(
        kind=STEP_KINDS[name],
        parent=parent,
        node=node,
        title=title[:200],
        params={"deployment": deployment.pk, "notify": [live.group_name(deployment.pk)], **params},
        # The run's own: whoever pressed the button (or the console), checked against each step's node.
        created_by=parent.created_by,
    )
    DeploymentStep.objects.create(deployment=deployment, job=job, name=name, order=order)
    return job


def create_launch_steps(deployment: Deployment, run: Job, *, after: int = 0) -> None:
    """The launch steps as children of `run`, numbered on from `after` (a heal run's come after its stops)."""
    workers = workers_of(deployment)
    coordinator = deployment.coordinator
    order = after
    for worker in workers:
        order += 1
        title = f"Reap port {worker.port} on {worker.node}"
        add_step(deployment, run, order, "reap", worker.node, title, ports=[worker.port])
    order += 1
    title = f"Reap port {deployment.port} on {coordinator}"
    add_step(deployment, run, order, "reap", coordinator, title, ports=[deployment.port])
    mode = rpc_mode(deployment, workers)
    coordinator_ip = ipv4_of(coordinator)
    local_ends: dict[str, str] = {}
    tunnels = []
    for worker in workers:
        here = worker.node.pk == coordinator.pk
        endpoint = worker.endpoint
        bind = worker_bind(worker, mode, coordinator)
        if mode == RpcMode.TUNNEL or here:
            # Only the coordinator reaches it: through its tunnel, or on its own loopback.
            exposed, firewall = False, None
            if here:
                local_ends[endpoint] = f"127.0.0.1:{worker.port}"
            else:
                tunnels.append((worker, endpoint))
        else:
            exposed = rpc_guard.binds_everywhere(bind)
            firewall = {
                "coordinator": coordinator_ip,
                "tag": rpc_guard.tag_for(deployment.pk, worker.node.name),
            }
        if exposed:
            record(
                run.created_by,
                "deployment.rpc_exposed",
                deployment,
                changes={"node": worker.node.name, "bind": bind, "port": worker.port},
                actor_name="" if run.created_by_id else "console",
            )
        order += 1
        add_step(
            deployment,
            run,
            order,
            "rpc-server",
            worker.node,
            f"Start ggml-rpc-server on {worker.node}:{worker.port}",
            args=with_bind(worker.args, bind),
            port=worker.port,
            bind=bind,
            exposed=exposed,
            firewall=firewall,
            needs=worker.needs,
        )
    for worker, endpoint in tunnels:
        order += 1
        title = f"Tunnel from {coordinator} to {worker.node}:{worker.port}"
        add_step(
            deployment,
            run,
            order,
            "rpc-tunnel",
            coordinator,
            title,
            worker=worker.node.pk,
            port=worker.port,
            endpoint=endpoint,
        )
    if workers:
        # The coordinator's own view of every worker, before llama-server depends on it.
        order += 1
        add_step(
            deployment,
            run,
            order,
            "preflight",
            coordinator,
            f"Check that {coordinator} reaches every worker",
            coordinator_ip=coordinator_ip,
            targets=[
                {
                    "node": worker.node.name,
                    "endpoint": worker.endpoint,
                    "port": worker.port,
                    "tunnel": any(worker is w for w, _ in tunnels),
                }
                for worker in workers
            ],
        )
    order += 1
    add_step(
        deployment,
        run,
        order,
        "llama-server",
        coordinator,
        f"Start llama-server on {coordinator}:{deployment.port}",
        local_ends=local_ends,
    )
    for step, title in (
        ("verify", "Verify the placement against the plan"),
        ("measure", "Measure decode and prompt speed"),
    ):
        order += 1
        add_step(deployment, run, order, step, coordinator, title)


def stop_steps(deployment: Deployment, parent: Job, name: str) -> list[Job]:
    """Stop steps per node for every process this deployment started: llama-server's node first."""
    by_node: dict[str, list[dict]] = {}
    for info in (deployment.processes or {}).values():
        by_node.setdefault(info["node"], []).append(info)
    guards: dict[str, list[dict]] = {}
    for info in (deployment.guards or {}).values():
        guards.setdefault(info["node"], []).append(info)
        by_node.setdefault(info["node"], [])
    coordinator = deployment.coordinator.name
    names = sorted(by_node, key=lambda n: (n != coordinator, n))
    nodes = {n.name: n for n in Node.objects.filter(name__in=names)}
    order = (deployment.steps.order_by("-order").values_list("order", flat=True).first() or 0) + 1
    jobs = []
    for offset, node_name in enumerate(names):
        if node_name not in nodes:
            continue  # The node was deleted since: nothing can reach its processes.
        processes = sorted(by_node[node_name], key=lambda p: p["role"] != "llama-server")
        verb = "Roll back" if name == "rollback" else "Stop"
        title = f"{verb} on {node_name}"
        jobs.append(
            add_step(
                deployment,
                parent,
                order + offset,
                name,
                nodes[node_name],
                title,
                processes=processes,
                guards=guards.get(node_name, []),
            )
        )
    return jobs


# --------------------------------------------------------------------------------------------------
# The buttons
# --------------------------------------------------------------------------------------------------


def start_deploy(deployment: Deployment, actor=None, *, again: bool = False) -> tuple[bool, str]:
    """The Deploy button. Pressing it twice starts one run; a refusal leaves the deployment as it was.

    With `again` (Redeploy, Restart) it is a new deploy run of a stopped or failed deployment, the same
    deployment: its earlier runs stay in its history."""
    reason = refusal(deployment) or local_refusal(deployment, actor)
    if reason:
        record(actor, "deployment.refused", deployment, changes={"reason": reason})
        return False, reason
    mark = deployment.mark_redeploying if again else deployment.mark_preparing
    try:
        with transaction.atomic():
            # Checked again under the nodes' row locks, with the claims below in the same transaction: a
            # calibration that started since the check above is seen here, or sees these claims itself.
            nodes = lock_nodes(deployment_nodes(deployment))
            if reason := calibration_refusal_of(nodes):
                raise _Refused(reason)
            if not mark():
                state = deployment.get_state_display().lower()
                if again:
                    return (
                        False,
                        f"This deployment is {state}: only a stopped or failed one is deployed again.",
                    )
                return False, f"This deployment is already {state}."
            verb = "Redeploy" if again else "Deploy"
            run = new_run(deployment, DEPLOY, f"{verb} {deployment}", actor=actor)
            create_launch_steps(deployment, run)
            record(
                actor,
                "deployment.redeploy" if again else "deployment.deploy",
                deployment,
                changes={
                    "plan_devices": len(deployment.plan["placements"]),
                    "run": run.pk,
                    "rpc_mode": rpc_mode(deployment),
                },
            )
            run.enqueue()
    except (ClaimConflict, _Refused) as exc:
        record(actor, "deployment.refused", deployment, changes={"reason": str(exc)})
        return False, str(exc)
    if again:
        return True, "Deploying again: a new run of the same deployment, its steps below."
    return True, "Deploying: the steps run one after another below."


def stop_deployment(deployment: Deployment, actor=None, *, then_redeploy: bool = False) -> tuple[bool, str]:
    """The Stop (and Restart) button. A deploy run still going is asked to cancel (a queued one is cancelled
    at once); an undeploy run on the control queue waits for it to end, then stops what was started.
    Pressed again while stopping, it starts a new undeploy run only when none is active (the last one was
    lost), so a deployment never stays stopping with its claims held."""
    prior = deployment.state
    if reason := local_refusal(deployment, actor):
        record(actor, "deployment.refused", deployment, changes={"reason": reason})
        return False, reason
    if active_run(deployment, RECALIBRATE) is not None:
        return False, "It is being stopped to calibrate a node and started again: cancel that run to stop it."
    with transaction.atomic():
        if (current := active_run(deployment, UNDEPLOY)) is not None:
            if current.state == JobState.QUEUED:
                # Pressed again while the stop waits: its message may be lost; sending it twice is harmless.
                transaction.on_commit(current.send_to_worker)
                return True, "Stopping: the stop was sent to a worker again."
            return False, "A stop or rollback of this deployment is already running."
        if prior != DeploymentState.STOPPING and not deployment.mark_stopping(
            reason="Stopped by an operator."
        ):
            return False, f"This deployment is {deployment.get_state_display().lower()}: nothing to stop."
        record(actor, "deployment.stop", deployment, changes={"from": prior, "restart": then_redeploy})
        start_undeploy(deployment, actor=actor, restart=then_redeploy)
    return True, "Stopping."


def start_undeploy(deployment: Deployment, *, actor=None, **params) -> Job:
    """Ask the deploy run (if one is active) to cancel and queue an undeploy run. `fail` in params makes
    it a rollback that fails the deployment with {"step", "reason"} afterwards."""
    for run in runs_of(deployment).filter(kind__in=LAUNCHING_RUNS, state__in=ACTIVE_JOB_STATES):
        run.request_cancel()
    verb = "Roll back" if params.get("fail") else "Restart" if params.get("restart") else "Stop"
    run = new_run(deployment, UNDEPLOY, f"{verb} {deployment}", actor=actor, **params)
    run.enqueue()
    return run


def redeploy(deployment: Deployment, actor=None) -> tuple[Deployment, bool, str]:
    """A new deploy run of a stopped or failed deployment, the same one (no second deployment of the same
    name): in one transaction its state, claims, steps, audit entry and the enqueue (on commit)."""
    started, message = start_deploy(deployment, actor, again=True)
    return deployment, started, message


# A deployment that runs nothing may be deleted: never confirmed further, or stopped, or failed.
DELETABLE_STATES = (DeploymentState.CONFIRMED, *REDEPLOYABLE_STATES)


def deletion_refusal(deployment: Deployment) -> str:
    """Why this deployment cannot be deleted now ("" when it can): while it runs, its processes and claims
    are what Stop ends; deleting it would leave them with nobody to stop them."""
    if deployment.state not in DELETABLE_STATES:
        state = deployment.get_state_display().lower()
        return (
            f"{deployment.name} is {state}: stop it first; a stopped, failed or confirmed one can be deleted."
        )
    if runs_of(deployment).filter(state__in=ACTIVE_JOB_STATES).exists():
        return f"A run of {deployment.name} is still finishing: delete it once that run has ended."
    return ""


def delete_deployment(deployment: Deployment, actor=None) -> tuple[bool, str]:
    """The Delete button: the deployment, its steps, claims and speed samples go; its runs' jobs and logs
    and the audit history stay. The delete is conditional on a state that runs nothing, so a Deploy pressed
    at the same moment either comes first (and the delete is refused) or finds nothing to deploy."""
    if reason := deletion_refusal(deployment):
        record(actor, "deployment.delete_refused", deployment, changes={"reason": reason})
        return False, reason
    with transaction.atomic():
        record(
            actor,
            "deployment.delete",
            deployment,
            changes={
                "state": deployment.state,
                "model": deployment.model_file.name,
                "endpoint": f"{deployment.host}:{deployment.port}",
            },
        )
        deleted, _ = Deployment.objects.filter(pk=deployment.pk, state__in=DELETABLE_STATES).delete()
        if not deleted:
            transaction.set_rollback(True)
            return False, f"{deployment.name} changed meanwhile; look at it again before deleting it."
    live.dashboard_changed()  # its own page is gone; the dashboard lists it no more
    return True, f"Deleted {deployment.name}."


def recalibrate_refusal(deployment: Deployment, node: Node | None, actor=None) -> str:
    """Why "stop, calibrate, start again" of `node` cannot run now, or "" when it can."""
    if node is None or node.pk not in {n.pk for n in deployment_nodes(deployment)}:
        return "Choose a node this deployment uses."
    if deployment.state not in (DeploymentState.RUNNING, DeploymentState.DEGRADED):
        state = deployment.get_state_display().lower()
        return f"{deployment.name} is {state}: calibrate {node.name} from its own page."
    if reason := local_refusal(deployment, actor):
        return reason
    if active_run(deployment, RECALIBRATE) or active_run(deployment, UNDEPLOY):
        return f"{deployment.name} is already being stopped."
    return calibration_refusal(node, besides=deployment)


def stop_calibrate_start(deployment: Deployment, node: Node | None, actor=None) -> tuple[bool, str]:
    """The node page's "Stop X, calibrate, start again": one run that stops the deployment, calibrates the
    node and deploys the same plan again (runs.py `recalibrate_body`), so a calibration is never queued to
    fail at once because the node serves a deployment. Refused with a reason before anything changes."""
    if reason := recalibrate_refusal(deployment, node, actor):
        record(actor, "deployment.refused", deployment, changes={"reason": reason})
        return False, reason
    with transaction.atomic():
        if not deployment.mark_stopping(
            reason=f"Stopped to calibrate {node.name}; the same plan starts again."
        ):
            return False, f"This deployment is {deployment.get_state_display().lower()}: nothing to stop."
        title = f"Stop {deployment.name}, calibrate {node.name}, start again"
        run = new_run(deployment, RECALIBRATE, title, actor=actor, calibrate=node.pk)
        record(actor, "deployment.recalibrate", deployment, changes={"node": node.name, "run": run.pk})
        run.enqueue()
    then = f"then calibrating {node.name}, then starting the same plan again"
    return True, f"Stopping {deployment.name}, {then}."
