"""A deployment's life as ordered jobs: reap → rpc-servers → llama-server → verify → measure → running; stop.

`start_deploy` is what the Deploy button calls: it refuses with a reason (no build, RPC protocols differ,
ports or devices held by another deployment), moves the deployment to preparing (claims included, in one
transaction), creates every step as a queued job so the page shows the whole run at once, and enqueues
`run_deployment` on commit. `run_deployment` runs the steps one after another in its worker; the first step
that does not succeed rolls back what this deployment started (by PID) and fails the deployment with that
step and reason. Stopping ends llama-server first, then the rpc-servers, and confirms the ports are free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from deployments import llamacpp
from deployments.build_job import protocol_mismatch
from deployments.models import ClaimConflict, Deployment, DeploymentState, DeploymentStep
from jobs.audit import record
from jobs.models import Job, JobState
from nodes.models import Build, Node

logger = logging.getLogger(__name__)

MID_DEPLOY_STATES = (DeploymentState.PREPARING, DeploymentState.LAUNCHING, DeploymentState.VERIFYING)
LAUNCH_STEPS = ("reap", "rpc-server", "llama-server", "verify", "measure")


@dataclass
class Worker:
    node: Node
    port: int
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
        worker = workers.setdefault(node.name, Worker(node, port))
        if item.get("device") not in worker.devices:
            worker.devices.append(item["device"])
        needed = sum(int(item.get(k) or 0) for k in ("weights_bytes", "kv_bytes", "compute_bytes"))
        worker.needs[item["device"]] = worker.needs.get(item["device"], 0) + needed
    for worker in workers.values():
        args = list(
            explicit.get(worker.node.name) or llamacpp.rpc_server_args("", worker.port, worker.devices)
        )
        # The plan names where to connect; the server binds where the node says (an admin may widen it).
        if "-H" in args:
            args[args.index("-H") + 1] = worker.node.rpc_bind_host
        else:
            args = ["-H", worker.node.rpc_bind_host, *args]
        # The local tensor cache makes a second load of the same model send almost nothing: on by default.
        worker.args = [*args, *([] if "-c" in args or "--cache" in args else ["-c"])]
    return list(workers.values())


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
    nodes = [deployment.coordinator, *(w.node for w in workers_of(deployment))]
    protocols: dict[str, str] = {}
    for node in nodes:
        build = node.current_build
        if build is None:
            return f"{node.name} has no llama.cpp build: build or register one on its page first."
        protocols[node.name] = build.rpc_protocol
    return protocol_mismatch(protocols)


# --------------------------------------------------------------------------------------------------
# Deploy
# --------------------------------------------------------------------------------------------------


def _add_step(
    deployment: Deployment, order: int, name: str, kind: str, node: Node, title: str, **params
) -> Job:
    job = Job.objects.create(
        kind=kind,
        node=node,
        title=title[:200],
        params={"deployment": deployment.pk, **params},
        created_by=deployment.created_by,
    )
    DeploymentStep.objects.create(deployment=deployment, job=job, name=name, order=order)
    return job


def create_launch_steps(deployment: Deployment) -> None:
    workers = workers_of(deployment)
    coordinator = deployment.coordinator
    order = 0
    for worker in workers:
        order += 1
        _add_step(
            deployment,
            order,
            "reap",
            "reap",
            worker.node,
            f"Reap port {worker.port} on {worker.node}",
            ports=[worker.port],
        )
    order += 1
    _add_step(
        deployment,
        order,
        "reap",
        "reap",
        coordinator,
        f"Reap port {deployment.port} on {coordinator}",
        ports=[deployment.port],
    )
    for worker in workers:
        if worker.node.rpc_binds_everywhere:
            record(
                deployment.created_by,
                "deployment.rpc_exposed",
                deployment,
                changes={"node": worker.node.name, "bind": worker.node.rpc_bind_host, "port": worker.port},
            )
        order += 1
        _add_step(
            deployment,
            order,
            "rpc-server",
            "launch",
            worker.node,
            f"Start ggml-rpc-server on {worker.node}:{worker.port}",
            step="rpc-server",
            args=worker.args,
            port=worker.port,
            bind=worker.node.rpc_bind_host,
            exposed=worker.node.rpc_binds_everywhere,
            needs=worker.needs,
        )
    for step, title in (
        ("llama-server", f"Start llama-server on {coordinator}:{deployment.port}"),
        ("verify", "Verify the placement against the plan"),
        ("measure", "Measure decode and prompt speed"),
    ):
        order += 1
        _add_step(deployment, order, step, "launch", coordinator, title, step=step)


def start_deploy(deployment: Deployment, actor=None) -> tuple[bool, str]:
    """The Deploy button. Pressing it twice starts one run; a refusal leaves the deployment confirmed."""
    reason = refusal(deployment)
    if reason:
        record(actor, "deployment.refused", deployment, changes={"reason": reason})
        return False, reason
    try:
        with transaction.atomic():
            if not deployment.mark_preparing():
                return False, f"This deployment is already {deployment.get_state_display().lower()}."
            create_launch_steps(deployment)
            record(
                actor,
                "deployment.deploy",
                deployment,
                changes={"plan_devices": len(deployment.plan["placements"])},
            )
            transaction.on_commit(lambda: _enqueue("deploy", deployment.pk))
    except ClaimConflict as exc:
        record(actor, "deployment.refused", deployment, changes={"reason": str(exc)})
        return False, str(exc)
    return True, "Deploying: the steps run one after another below."


def _enqueue(task: str, pk: int) -> None:
    from deployments import tasks

    getattr(tasks, task).delay(pk)


def _run(job: Job, worker: str = "") -> Job:
    """Run a step inline, under the Celery worker's name: the sweeper asks the workers by that name
    whether they still run it (the runner's default, host:PID, is no worker's name)."""
    from jobs.runner import run_job

    run_job(job.pk, worker=worker)
    job.refresh_from_db()
    return job


def _heartbeat_is_fresh(job: Job) -> bool:
    from jobs.sweeper import STALE_AFTER_S

    beat = job.heartbeat_at or job.started_at
    return bool(beat) and beat >= timezone.now() - timedelta(seconds=STALE_AFTER_S)


def _abandon_if_stale(job: Job) -> bool:
    """A step left running by a dead worker (no heartbeat for a while) is marked errored, so the run can
    roll back and fail instead of waiting forever. True when the step is no longer running."""
    from jobs.sweeper import abandon

    if _heartbeat_is_fresh(job):
        return False
    abandon(job, "Worker lost: the step's runner stopped beating while the deployment was launching.")
    job.refresh_from_db()
    return job.state != JobState.RUNNING


def _skip_rest(steps, reason: str) -> None:
    for step in steps:
        if step.job.state == JobState.QUEUED:
            step.job.finish(JobState.CANCELLED, result=reason)


def run_deployment(pk: int, worker: str = "") -> None:
    """Run the steps of a deployment in order (the body of the `deploy` task).

    A second delivery of the task resumes where the first left off: succeeded steps are skipped, a step
    still running with a fresh heartbeat belongs to the other delivery (nothing to do), and a step that
    ended badly while no one watched, or still says running with a stale heartbeat (its worker died),
    fails the deployment and rolls it back.
    """
    deployment = Deployment.objects.select_related("coordinator", "model_file").get(pk=pk)
    steps = [
        s
        for s in deployment.steps.select_related("job", "job__node").order_by("order")
        if s.name in LAUNCH_STEPS
    ]
    if deployment.state == DeploymentState.STOPPING and all(s.job.state == JobState.QUEUED for s in steps):
        # Stopped before the run began: nothing started, but the stop is this run's to finish.
        _skip_rest(steps, "Skipped: the deployment was stopped.")
        return finish_stop(deployment, worker)
    if deployment.state not in MID_DEPLOY_STATES:
        logger.info("Deployment %s is %s: nothing to run.", pk, deployment.state)
        return None
    for index, step in enumerate(steps):
        job = step.job
        if job.state == JobState.SUCCEEDED:
            continue
        if job.state == JobState.RUNNING and not _abandon_if_stale(job):
            logger.info("Deployment %s: step %s is running under another delivery.", pk, step.name)
            return None
        deployment.refresh_from_db()
        if deployment.state == DeploymentState.STOPPING:
            _skip_rest(steps[index:], "Skipped: the deployment was stopped.")
            return finish_stop(deployment, worker)
        if deployment.state not in MID_DEPLOY_STATES:
            return _skip_rest(steps[index:], f"Skipped: the deployment is {deployment.state}.")
        if step.name != "reap" and deployment.state == DeploymentState.PREPARING:
            deployment.mark_launching()
        if step.name == "verify":
            deployment.mark_verifying()
        if job.state == JobState.QUEUED:
            job = _run(job, worker)
        if job.state == JobState.SUCCEEDED:
            continue
        deployment.refresh_from_db()
        _skip_rest(steps[index + 1 :], f"Skipped: step {step.name} did not succeed.")
        if deployment.state == DeploymentState.STOPPING:
            return finish_stop(deployment, worker)
        if deployment.state not in MID_DEPLOY_STATES:
            return None  # A stop task finished it meanwhile (and cancelled this step): nothing to undo.
        reason = f"{step.name} on {job.node_name}: {job.result or job.get_state_display()}"
        return _fail_and_roll_back(deployment, step.name, reason, worker)
    if deployment.mark_running():
        record(
            deployment.created_by,
            "deployment.running",
            deployment,
            changes={
                "decode_tps": deployment.measured_decode_tps,
                "prompt_tps": deployment.measured_prompt_tps,
            },
        )
    return None


# --------------------------------------------------------------------------------------------------
# Stop and roll back
# --------------------------------------------------------------------------------------------------


def _stop_jobs(deployment: Deployment, name: str) -> list[Job]:
    """Stop jobs per node for every process this deployment started: llama-server's node first."""
    by_node: dict[str, list[dict]] = {}
    for info in (deployment.processes or {}).values():
        by_node.setdefault(info["node"], []).append(info)
    coordinator = deployment.coordinator.name
    names = sorted(by_node, key=lambda n: (n != coordinator, n))
    nodes = {n.name: n for n in Node.objects.filter(name__in=names)}
    order = (deployment.steps.order_by("-order").values_list("order", flat=True).first() or 0) + 1
    jobs = []
    for offset, node_name in enumerate(names):
        processes = sorted(by_node[node_name], key=lambda p: p["role"] != "llama-server")
        jobs.append(
            _add_step(
                deployment,
                order + offset,
                name,
                "stop",
                nodes[node_name],
                f"{'Roll back' if name == 'rollback' else 'Stop'} on {node_name}",
                processes=processes,
            )
        )
    return jobs


def _fail_and_roll_back(deployment: Deployment, step: str, reason: str, worker: str = "") -> None:
    """Roll back what this deployment started, then fail it. When the rollback is not clean, the reason
    says which processes may still run and that they need stopping (the stale-process scan will list them,
    with a reap button), so nobody takes the ports for free."""
    failures = rollback(deployment, worker)
    if failures:
        reason += "\n\nRollback incomplete, stop needed: these processes may still be running: " + "; ".join(
            failures
        )
    deployment.fail(step, reason)
    record(
        deployment.created_by,
        "deployment.failed",
        deployment,
        changes={"step": step, "reason": reason, "rollback_failures": failures},
    )


def rollback(deployment: Deployment, worker: str = "") -> list[str]:
    """End, by PID, whatever this deployment started. Returns the failures (empty when all is clean)."""
    return [
        f"{job.node_name}: {job.result}"
        for job in (_run(j, worker) for j in _stop_jobs(deployment, "rollback"))
        if job.state != JobState.SUCCEEDED
    ]


def finish_stop(deployment: Deployment, worker: str = "") -> None:
    failures = [
        f"{job.node_name}: {job.result}"
        for job in (_run(j, worker) for j in _stop_jobs(deployment, "stop"))
        if job.state != JobState.SUCCEEDED
    ]
    if failures:
        deployment.fail("stop", "; ".join(failures))
        record(deployment.created_by, "deployment.stop_failed", deployment, changes={"reason": failures})
    elif deployment.mark_stopped():
        record(deployment.created_by, "deployment.stopped", deployment, changes={"ports_free": True})


def stop_deployment(deployment: Deployment, actor=None, *, then_redeploy: bool = False) -> tuple[bool, str]:
    """The Stop button. A deployment in the middle of launching stops after its current step (which is
    asked to cancel) when a live run owns it; a running one, or one whose run died, is stopped by a task."""
    prior = deployment.state
    with transaction.atomic():
        if not deployment.mark_stopping(reason="Stopped by an operator."):
            return False, f"This deployment is {deployment.get_state_display().lower()}: nothing to stop."
        record(actor, "deployment.stop", deployment, changes={"from": prior, "restart": then_redeploy})
        if prior in MID_DEPLOY_STATES:
            running = [
                s.job for s in deployment.steps.select_related("job").filter(job__state=JobState.RUNNING)
            ]
            for job in running:
                job.request_cancel()
            if not _live_run_owns(deployment, running):
                transaction.on_commit(lambda: _enqueue("stop", deployment.pk))
        else:
            task = "restart" if then_redeploy else "stop"
            transaction.on_commit(lambda: _enqueue(task, deployment.pk))
    return True, "Stopping."


def _live_run_owns(deployment: Deployment, running: list[Job]) -> bool:
    """Will a deploy run finish this stop? Yes while one of its steps beats, or before the run began (every
    step queued: the deploy task is on its way and finishes the stop itself). Otherwise its worker died."""
    if any(_heartbeat_is_fresh(job) for job in running):
        return True
    states = set(deployment.steps.filter(name__in=LAUNCH_STEPS).values_list("job__state", flat=True))
    return states == {JobState.QUEUED}


def run_stop(pk: int, worker: str = "") -> None:
    deployment = Deployment.objects.select_related("coordinator").get(pk=pk)
    if deployment.state != DeploymentState.STOPPING:
        return
    # Steps not begun never will: a deploy run still between steps finds its next one cancelled.
    steps = deployment.steps.select_related("job").filter(name__in=LAUNCH_STEPS)
    _skip_rest(steps, "Skipped: the deployment was stopped.")
    finish_stop(deployment, worker)


def abort_deployment(pk: int, reason: str, worker: str = "") -> None:
    """The deploy task ran out of time: mark its running step errored, skip the rest, roll back, fail."""
    from jobs.sweeper import abandon

    deployment = Deployment.objects.select_related("coordinator").get(pk=pk)
    steps = list(deployment.steps.select_related("job", "job__node").filter(name__in=LAUNCH_STEPS))
    current = next((s for s in steps if s.job.state == JobState.RUNNING), None)
    if current is not None:
        abandon(current.job, reason)
    _skip_rest(steps, f"Skipped: {reason}")
    if deployment.state == DeploymentState.STOPPING:
        return finish_stop(deployment, worker)
    if deployment.state in MID_DEPLOY_STATES:
        _fail_and_roll_back(deployment, current.name if current else "deploy", reason, worker)
    return None


def redeploy(deployment: Deployment, actor=None) -> tuple[Deployment, bool, str]:
    """A new deployment from the same plan (history keeps the old one), launched at once.

    One transaction: the new row, its audit entry, its steps and the enqueue (on commit) all or nothing."""
    with transaction.atomic():
        fresh = Deployment.objects.create(
            name=deployment.name,
            model_file=deployment.model_file,
            coordinator=deployment.coordinator,
            plan=deployment.plan,
            plan_settings=deployment.plan_settings,
            host=deployment.host,
            port=deployment.port,
            redeployed_from=deployment,
            created_by=actor if getattr(actor, "is_authenticated", False) else deployment.created_by,
        )
        record(actor, "deployment.redeploy", fresh, changes={"from": deployment.pk})
        started, message = start_deploy(fresh, actor)
    return fresh, started, message


def run_restart(pk: int, worker: str = "") -> None:
    """Stop, then redeploy the same plan as a new deployment."""
    run_stop(pk, worker)
    deployment = Deployment.objects.get(pk=pk)
    if deployment.state == DeploymentState.STOPPED:
        redeploy(deployment, deployment.created_by)


def deployment_builds(deployment: Deployment) -> dict[str, Build | None]:
    return {
        n.name: n.current_build for n in [deployment.coordinator, *(w.node for w in workers_of(deployment))]
    }
