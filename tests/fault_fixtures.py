"""The fault suite's lab (`pytest -m faults`): two lab hosts over real sshd with the console's own llama.cpp
build, a generated model, real Celery workers (a work worker and a control worker, as `make run` starts
them) on queues of the test's own, and the checks every fault test ends with: the database consistent,
every claim released or held by a live deployment, the audit history complete, no process of ours left
on any host that no deployment accounts for."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from audit.models import AuditEvent
from deployments.lifecycle import actions as lifecycle
from deployments.models import ACTIVE_STATES, Deployment, DeploymentState, ResourceClaim
from jobs import sweeper
from jobs.models import ACTIVE_STATES as ACTIVE_JOB_STATES
from jobs.models import Job
from tests.deploy_fixtures import Cluster
from tests.job_fixtures import CeleryWorker, wait_for
from tests.llamacpp_build import use_cached_llamacpp

TERMINAL = (DeploymentState.STOPPED, DeploymentState.FAILED)


class FaultLab(Cluster):
    """The end-to-end test's cluster (coordinator + one worker host), with Celery workers of its own."""

    def __init__(self, lab, hosts, tmp_path):
        super().__init__(lab, hosts, tmp_path)
        self.celery: list[CeleryWorker] = []
        self.queue: str | None = None

    def start_workers(self) -> tuple[CeleryWorker, CeleryWorker]:
        """A work worker and a control worker sharing this test's queues (the work one owns the settings
        that make the console send there)."""
        return self.start_worker(consume=("work",)), self.start_worker(consume=("control",))

    def start_worker(self, *, consume=("work", "control"), name: str | None = None) -> CeleryWorker:
        """A worker on this test's queues; the first one also makes them the console's queues."""
        worker = CeleryWorker(
            self.tmp_path, name, default_queue=not self.celery, queue=self.queue, consume=consume
        ).start()
        self.queue = worker.queue
        self.celery.append(worker)
        return worker

    def stop_workers(self) -> None:
        for worker in reversed(self.celery):
            worker.stop()

    def ready(self) -> Deployment:
        """Builds on both hosts (cached after the first run) and a confirmed deployment of the tiny model."""
        self.build_all()
        return self.confirm(self.model())

    def wait_state(self, deployment: Deployment, states, timeout: float = 240) -> Deployment:
        states = {states} if isinstance(states, str) else set(states)

        def reached():
            deployment.refresh_from_db()
            return deployment.state in states

        wait_for(reached, timeout=timeout, interval=0.2, what=f"deployment {deployment.pk} to be {states}")
        return deployment

    def settle(self, deployment: Deployment, timeout: float = 300) -> Deployment:
        """Until the deployment is stopped, failed, running or degraded and none of its jobs is active,
        sweeping as beat would (more often: the test does not wait for beat's interval)."""

        def settled():
            sweeper.sweep()
            sweeper.sweep_queued()
            deployment.refresh_from_db()
            active = jobs_of(deployment).filter(state__in=ACTIVE_JOB_STATES).exists()
            return not active and deployment.state not in lifecycle.MID_DEPLOY_STATES + (
                DeploymentState.STOPPING,
            )

        wait_for(settled, timeout=timeout, interval=1.0, what=f"deployment {deployment.pk} to settle")
        return deployment


def jobs_of(deployment: Deployment):
    return Job.objects.filter(params__deployment=deployment.pk)


def our_processes(hosts) -> dict[int, str]:
    """Every rpc-server and llama-server running in the lab hosts' namespaces: {pid: command line}."""
    found = {}
    for host in hosts:
        pids = subprocess.run(
            ["ip", "netns", "pids", host.netns], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except FileNotFoundError:
                continue
            if "rpc-server" in cmd or "llama-server" in cmd:
                found[int(pid)] = cmd
    return found


def assert_consistent(lab: FaultLab, *deployments: Deployment) -> None:
    """What every fault test ends with."""
    accounted: set[int] = set()
    for deployment in deployments:
        deployment.refresh_from_db()
        active_jobs = list(jobs_of(deployment).filter(state__in=ACTIVE_JOB_STATES).values_list("pk", "kind"))
        assert not active_jobs, f"jobs still active: {active_jobs}"
        claims = ResourceClaim.objects.filter(deployment=deployment)
        if deployment.state in ACTIVE_STATES:
            assert deployment.state in (DeploymentState.RUNNING, DeploymentState.DEGRADED), deployment.state
            assert claims.exists()  # held by a live deployment
            accounted |= {int(info["pid"]) for info in deployment.processes.values()}
        else:
            assert not claims.exists(), f"{deployment} is {deployment.state} and still holds claims"
        actions = set(
            AuditEvent.objects.filter(object_type="deployment", object_id=str(deployment.pk)).values_list(
                "action", flat=True
            )
        )
        if deployment.state != DeploymentState.CONFIRMED:
            assert "deployment.deploy" in actions, actions
        if deployment.state == DeploymentState.STOPPED:
            assert {"deployment.stop", "deployment.stopped"} <= actions, actions
        if deployment.state == DeploymentState.FAILED:
            assert actions & {"deployment.failed", "deployment.stop_failed"}, actions
        if deployment.state == DeploymentState.RUNNING:
            assert "deployment.running" in actions, actions
    stray = {pid: cmd for pid, cmd in our_processes(lab.hosts).items() if pid not in accounted}
    assert not stray, f"processes of ours that no deployment accounts for: {stray}"
    for claim in ResourceClaim.objects.select_related("deployment"):
        assert claim.deployment.state in ACTIVE_STATES, (
            f"{claim} held by a {claim.deployment.state} deployment"
        )


def wait_step(deployment: Deployment, name: str, states, timeout: float = 240) -> Job:
    states = {states} if isinstance(states, str) else set(states)
    return wait_for(
        lambda: deployment.steps.filter(name=name, job__state__in=states).select_related("job").first(),
        timeout=timeout,
        interval=0.1,
        what=f"step {name} to be {states}",
    ).job


@pytest.fixture
def fault_lab(lab, lab_hosts, tmp_path, settings):
    use_cached_llamacpp(settings)  # builds upload the pinned source and find it compiled
    cluster = FaultLab(lab, lab_hosts(2), tmp_path)
    yield cluster
    cluster.stop_workers()


def timed(label: str, start: float) -> float:
    elapsed = time.monotonic() - start
    print(f"\nFAULT {label}: {elapsed:.1f} s")
    return elapsed
