"""The bodies of a deployment's two runs, and what happens when a run ends badly.

`deploy_body` runs the steps in order through `ctx.run_child` (so the runner supervises each: heartbeat,
cancel, time limit, worker loss) and moves the deployment through preparing → launching → verifying →
running; the first step that does not succeed rolls back what this deployment started (by PID) and fails
the deployment with that step and reason. `undeploy_body` waits for a deploy run still going to end (it
was asked to cancel), then ends the deployment's processes node by node, llama-server first, and confirms
the ports are free; with params["fail"] it is the rollback of a run that was lost or ran out of time.

`deploy_ended` and `undeploy_ended` are the kinds' `on_end` hooks (jobs/kinds.py): a deploy run that ended
badly without failing the deployment itself (its worker died, it ran past its time limit, it crashed)
queues a rollback; a stop run whose worker died is started again, a few times, so a deployment never stays
stopping with its claims held.
"""

from __future__ import annotations

import asyncio
import logging

from audit.history import record
from deployments.lifecycle.actions import (
    LAUNCHING_RUNS,
    MAX_UNDEPLOY_RUNS,
    MID_DEPLOY_STATES,
    UNDEPLOY,
    active_run,
    add_step,
    redeploy,
    runs_of,
    start_undeploy,
    stop_steps,
)
from deployments.models import Deployment, DeploymentState
from deployments.steps.common import load_deployment
from jobs import sweeper
from jobs.aio import db
from jobs.context import JobCancelled, JobContext, JobFailed
from jobs.models import ACTIVE_STATES as ACTIVE_JOB_STATES
from jobs.models import Job, JobState
from nodes.models import Node

logger = logging.getLogger(__name__)

# How often the undeploy run looks at the deploy run it waits for.
WAIT_POLL_S = 0.5


def _steps_of(run: Job) -> list[tuple[str, Job]]:
    steps = run.children.select_related("deployment_step").order_by("deployment_step__order", "pk")
    return [(job.deployment_step.name, job) for job in steps]


def _state_of(deployment: Deployment) -> str:
    deployment.refresh_from_db(fields=["state"])
    return deployment.state


# The actor of what the console did or saw on its own (a run's outcome, a rollback), not a person's act.
SYSTEM_ACTOR = "console"


def audit_run(deployment: Deployment, action: str, changes: dict) -> None:
    """An audit entry of a run's outcome: the console's, not whoever created the deployment (the person's
    own act, pressing Deploy or Stop, has its entry already)."""
    record(None, action, deployment, changes=changes, actor_name=SYSTEM_ACTOR)


# --------------------------------------------------------------------------------------------------
# deploy
# --------------------------------------------------------------------------------------------------


async def deploy_body(ctx: JobContext) -> str:
    deployment = await load_deployment(ctx)
    await run_steps(ctx, deployment, on_failure=fail_and_roll_back)
    return f"{deployment} is running."


async def run_steps(ctx: JobContext, deployment: Deployment, *, on_failure) -> None:
    """The run's steps in order; the first that does not succeed is handed to `on_failure(ctx, deployment,
    step, reason)` and fails the run."""
    for name, step in await db(_steps_of)(ctx.job):
        await _check_still_deploying(deployment)
        if name != "reap" and deployment.state == DeploymentState.PREPARING:
            await db(deployment.mark_launching)()
        if name == "verify":
            await db(deployment.mark_verifying)()
        done = await ctx.run_child(step)
        if done.state == JobState.SUCCEEDED:
            continue
        await _check_still_deploying(deployment)  # A Stop that came while the step ran: the stop run's job.
        reason = f"{name} on {done.node_name}: {done.result or done.get_state_display()}"
        await on_failure(ctx, deployment, name, reason)
        raise JobFailed(reason)
    # The measure step saved its figures on its own copy of the deployment: read them before saying them.
    await db(deployment.refresh_from_db)(fields=["measured_decode_tps", "measured_prompt_tps"])
    if await db(deployment.mark_running)():
        speeds = {"decode_tps": deployment.measured_decode_tps, "prompt_tps": deployment.measured_prompt_tps}
        # Only what was measured: a figure not taken is left out, not written as "—".
        await db(audit_run)(deployment, "deployment.running", {k: v for k, v in speeds.items() if v})


async def _check_still_deploying(deployment: Deployment) -> None:
    state = await db(_state_of)(deployment)
    if state == DeploymentState.STOPPING:
        raise JobCancelled("The deployment is being stopped: its stop run ends what this run started.")
    if state not in MID_DEPLOY_STATES:
        raise JobCancelled(f"The deployment is {state}: nothing more to run.")


async def fail_and_roll_back(ctx: JobContext, deployment: Deployment, step: str, reason: str) -> list[str]:
    """Roll back what this deployment started, then fail it. When the rollback is not clean, the reason
    says which processes may still run and that they need stopping (the stale-process scan will list them,
    with a reap button), so nobody takes the ports for free."""
    failures = await teardown(ctx, deployment, "rollback")
    if failures:
        reason += "\n\nRollback incomplete, stop needed: these processes may still be running: " + "; ".join(
            failures
        )
    await db(deployment.fail)(step, reason)
    await db(audit_run)(
        deployment, "deployment.failed", {"step": step, "reason": reason, "rollback_failures": failures}
    )
    return failures


async def teardown(ctx: JobContext, deployment: Deployment, name: str) -> list[str]:
    """End, by PID, whatever this deployment started, one step per node as children of this run. Returns
    the failures (empty when all is clean)."""
    await db(deployment.refresh_from_db)(fields=["processes", "guards"])
    failures = []
    for step in await db(stop_steps)(deployment, ctx.job, name):
        done = await ctx.run_child(step)
        if done.state != JobState.SUCCEEDED:
            failures.append(f"{done.node_name}: {done.result}")
    return failures


# --------------------------------------------------------------------------------------------------
# undeploy (stop, restart, and the rollback of a lost run)
# --------------------------------------------------------------------------------------------------


async def undeploy_body(ctx: JobContext) -> str:
    deployment = await load_deployment(ctx)
    await wait_for_deploy_run(ctx, deployment)
    state = await db(_state_of)(deployment)
    fail = ctx.job.params.get("fail")
    if fail:
        if state not in (*MID_DEPLOY_STATES, DeploymentState.STOPPING):
            return f"Nothing to roll back: the deployment is {state}."
        await fail_and_roll_back(ctx, deployment, fail["step"], fail["reason"])
        return f"Rolled back; the deployment failed at step {fail['step']}."
    if state != DeploymentState.STOPPING:
        return f"Nothing to stop: the deployment is {state}."
    await stop_processes(ctx, deployment, "Stopping did not end everything")
    if ctx.job.params.get("restart"):
        # Whoever pressed Restart (the stop run's creator), else the deployment's.
        actor = await db(lambda: ctx.job.created_by or deployment.created_by)()
        _same, started, message = await db(redeploy)(deployment, actor)
        await ctx.log(f"Deploying {deployment} again: {message}")
        return "Stopped; deploying it again." if started else f"Stopped; not deployed again: {message}"
    return "Stopped; every process it started is ended and its ports are free."


async def stop_processes(ctx: JobContext, deployment: Deployment, failure: str) -> None:
    """End every process the deployment started and mark it stopped (audited); when something could not
    be ended the deployment fails and so does the run, its message starting with `failure`."""
    failures = await teardown(ctx, deployment, "stop")
    if failures:
        await db(deployment.fail)("stop", "; ".join(failures))
        await db(audit_run)(deployment, "deployment.stop_failed", {"reason": failures})
        raise JobFailed(f"{failure}: " + "; ".join(failures))
    if await db(deployment.mark_stopped)():
        await db(audit_run)(deployment, "deployment.stopped", {"ports_free": True})


# --------------------------------------------------------------------------------------------------
# recalibrate (stop, calibrate a node, start the same plan again)
# --------------------------------------------------------------------------------------------------


def _calibrate_step(deployment: Deployment, run: Job) -> Job:
    node = Node.objects.get(pk=run.params["calibrate"])
    order = (deployment.steps.order_by("-order").values_list("order", flat=True).first() or 0) + 1
    return add_step(deployment, run, order, "calibrate", node, f"Calibrate {node.name}")


async def recalibrate_body(ctx: JobContext) -> str:
    """Stop the deployment as Stop does, calibrate the node once its processes are ended and its claims
    released, then deploy the same plan again (as Restart does: a new run of the same deployment).
    It starts again even when the calibration fails: the household gets its model back, with old figures."""
    deployment = await load_deployment(ctx)
    await wait_for_deploy_run(ctx, deployment)
    state = await db(_state_of)(deployment)
    if state != DeploymentState.STOPPING:
        return f"Nothing to do: the deployment is {state}."
    await stop_processes(ctx, deployment, "Stopping did not end everything, so nothing was calibrated")
    step = await db(_calibrate_step)(deployment, ctx.job)
    calibrated = await ctx.run_child(step)
    actor = await db(lambda: ctx.job.created_by or deployment.created_by)()
    fresh, started, message = await db(redeploy)(deployment, actor)
    await ctx.log(f"Started again as {fresh}: {message}")
    if calibrated.state != JobState.SUCCEEDED:
        raise JobFailed(
            f"Calibrating {calibrated.node_name} did not succeed ({calibrated.result or calibrated.state}); "
            f"the plan started again as {fresh} with the figures it had."
        )
    if not started:
        raise JobFailed(f"Calibrated {calibrated.node_name}, but the plan did not start again: {message}")
    return f"Stopped, calibrated {calibrated.node_name}, started again as {fresh}."


def recalibrate_ended(run: Job) -> None:
    """A recalibrate run that ended before it stopped the deployment (its worker was lost, it was cancelled)
    leaves it stopping with its claims held: a stop run takes over, and starts the plan again unless a
    person cancelled."""
    if run.state in (JobState.SUCCEEDED, JobState.FAILED):
        return
    deployment = (
        Deployment.objects.filter(pk=run.params.get("deployment")).select_related("coordinator").first()
    )
    if deployment is None or deployment.state not in (*MID_DEPLOY_STATES, DeploymentState.STOPPING):
        return
    if active_run(deployment, UNDEPLOY) is not None:
        return
    start_undeploy(deployment, restart=run.state != JobState.CANCELLED)


def _deploy_run_state(deployment: Deployment) -> Job | None:
    """The active deploy run, asked to cancel (a queued one is cancelled here and now)."""
    run = (
        Job.objects.filter(
            kind__in=LAUNCHING_RUNS, params__deployment=deployment.pk, state__in=ACTIVE_JOB_STATES
        )
        .select_related("node")
        .first()
    )
    if run is not None and not run.cancel_requested:
        run.request_cancel()
    return run


async def wait_for_deploy_run(ctx: JobContext, deployment: Deployment) -> None:
    """Until no deploy run of the deployment is active: a live one ends at its next step (it was asked to
    cancel, and its runner ends the running step's process); one whose worker died is declared lost here
    as the sweeper would, rather than waited for."""
    announced = None
    stale_after = sweeper.STALE_AFTER_S
    while True:
        run = await db(_deploy_run_state)(deployment)
        if run is None or run.state not in ACTIVE_JOB_STATES:
            return
        if announced != run.pk:
            await ctx.log(f"Waiting for the deploy run (job {run.pk}) to end: it was asked to cancel.")
            announced = run.pk
        if run.state == JobState.RUNNING and await db(sweeper.is_lost)(run, stale_after=stale_after):
            await ctx.log(f"The deploy run (job {run.pk}) lost its worker; it is marked so.")
            await db(sweeper.sweep_one)(run, stale_after=stale_after)
        await asyncio.sleep(WAIT_POLL_S)


# --------------------------------------------------------------------------------------------------
# on_end hooks of the two kinds
# --------------------------------------------------------------------------------------------------


def _failed_step(run: Job) -> str:
    """The name of the step that was running or failed when the run ended, else "deploy"."""
    for name, step in _steps_of(run):
        if step.started_at and step.state != JobState.SUCCEEDED:
            return name
    return "deploy"


def deploy_ended(run: Job) -> None:
    """A deploy run ended. When it did not leave the deployment running, failed or stopping itself (it
    was lost, ran past its time limit, crashed, or someone cancelled it on its job page), queue what
    undoes it, so the deployment never stays mid-deploy with nobody working on it."""
    if run.state == JobState.SUCCEEDED:
        return
    deployment = (
        Deployment.objects.filter(pk=run.params.get("deployment")).select_related("coordinator").first()
    )
    if deployment is None or deployment.state not in MID_DEPLOY_STATES:
        return
    if active_run(deployment, UNDEPLOY) is not None:
        return
    step = _failed_step(run)
    if run.state == JobState.CANCELLED and run.result == "Cancelled by an operator.":
        if deployment.mark_stopping(reason="The deploy run was cancelled on its job page."):
            audit_run(deployment, "deployment.stop", {"from": "run cancelled", "run": run.pk})
        start_undeploy(deployment)
        return
    reason = f"{step}: {run.result or run.get_state_display()}"
    logger.warning("Deployment %s: deploy run %s ended %s; rolling back.", deployment.pk, run.pk, run.state)
    start_undeploy(deployment, fail={"step": step, "reason": reason})


def undeploy_ended(run: Job) -> None:
    """A stop run whose worker was lost is started again (a few times at most, then the deployment fails
    naming it), so no deployment stays stopping with its claims held."""
    if run.state != JobState.ERRORED:
        return
    deployment = (
        Deployment.objects.filter(pk=run.params.get("deployment")).select_related("coordinator").first()
    )
    if deployment is None or deployment.state not in (*MID_DEPLOY_STATES, DeploymentState.STOPPING):
        return
    if active_run(deployment, UNDEPLOY) is not None:
        return
    params = {k: v for k, v in run.params.items() if k not in ("deployment", "notify")}
    if runs_of(deployment, UNDEPLOY).count() < MAX_UNDEPLOY_RUNS:
        start_undeploy(deployment, **params)
        return
    reason = (
        f"Stopping failed {MAX_UNDEPLOY_RUNS} times, last: {run.result}. Check its processes and reap them."
    )
    if deployment.fail("stop", reason):
        audit_run(deployment, "deployment.stop_failed", {"reason": [reason]})
