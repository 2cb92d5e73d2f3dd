"""Per-page query counts do not grow with the inventory: each page is fetched with N nodes, jobs, deployments
and audit rows, then again with 10 N, and must run the same number of queries (no N+1)."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from audit import history
from builds.models import Build, BuildSource
from deployments.models import Deployment, DeploymentState, DeploymentStep, StaleProcess
from deployments.views.run import log_tails
from jobs.models import Job, JobLogLine, JobState
from llamacpp import gguf as gguf_profile
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import CredentialKind, DeviceKind, Reachability
from tests.factories import CredentialFactory, DeviceFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.security

N = 3


def add_rows(count: int, admin, first: dict | None = None) -> dict:
    """`count` more of everything the pages list: nodes with devices and builds, jobs with log lines,
    models with running deployments, stale processes and audit entries; and, for the first node and
    deployment made (`first`), `count` more jobs, deployment steps and audit entries of their own."""
    now = timezone.now()
    made: dict = {"nodes": [], "jobs": [], "deployments": []}
    credential = CredentialFactory(kind=CredentialKind.PASSWORD)
    for _ in range(count):
        node = NodeFactory(credential=credential, reachability=Reachability.REACHABLE, last_seen_at=now)
        DeviceFactory(node=node, name="CPU", kind=DeviceKind.CPU)
        DeviceFactory(node=node, name="CUDA0", kind=DeviceKind.CUDA)
        Build.objects.create(node=node, source_kind=BuildSource.TARBALL, source="x.tar.gz", version="b1")
        job = Job.objects.create(
            kind="command",
            node=node,
            title=f"echo on {node.name}",
            state=JobState.SUCCEEDED,
            created_by=admin,
            started_at=now,
            finished_at=now,
        )
        JobLogLine.objects.bulk_create([JobLogLine(job=job, seq=i, text=f"line {i}") for i in range(3)])
        model = ModelFile.objects.create(name=f"model-of-{node.name}", node=node, path="/m.gguf", profile={})
        deployment = Deployment.objects.create(
            name=f"deployment on {node.name}",
            model_file=model,
            coordinator=node,
            plan={},
            state=DeploymentState.RUNNING,
            created_by=admin,
        )
        StaleProcess.objects.create(node=node, port=50052, pid=1000 + node.pk, program="ggml-rpc-server")
        for action in ("node.create", "node.update", "node.probe"):
            history.record(admin, action, node, changes={"address": ["a", node.address]})
        made["nodes"].append(node)
        made["jobs"].append(job)
        made["deployments"].append(deployment)
        anchor_node = (first or made)["nodes"][0]
        anchor_deployment = (first or made)["deployments"][0]
        step_job = Job.objects.create(
            kind="rpc_server", node=anchor_node, title="rpc-server", created_by=admin
        )
        step_job.append_lines([("out", f"step line {i}") for i in range(8)])
        order = anchor_deployment.steps.count()
        DeploymentStep.objects.create(
            deployment=anchor_deployment, job=step_job, name="rpc-server", order=order
        )
        history.record(admin, "node.probe", anchor_node, changes={"job": step_job.pk})
        DeviceFactory(node=anchor_node, name=f"Vulkan{node.pk}", kind=DeviceKind.VULKAN)
        Build.objects.create(node=anchor_node, source_kind=BuildSource.GIT, source="https://x.test/l.git")
    return made


PAGES = {
    "dashboard": lambda first: reverse("dashboard"),
    "nodes:list": lambda first: reverse("nodes:list"),
    "nodes:credentials": lambda first: reverse("nodes:credentials"),
    "nodes:detail": lambda first: reverse("nodes:detail", args=[first["nodes"][0].name]),
    "jobs:list": lambda first: reverse("jobs:list"),
    "jobs:detail": lambda first: reverse("jobs:detail", args=[first["jobs"][0].pk]),
    "audit": lambda first: reverse("audit"),
    "modelfiles:list": lambda first: reverse("modelfiles:list"),
    # Every enabled node offered a copy, with what it pays by the model's deployments.
    "modelfiles:detail": lambda first: reverse("modelfiles:detail", args=[first["model"].pk]),
    # The planner's pool: every enabled node with its devices.
    "deployments:plan": lambda first: reverse("deployments:plan", args=[first["model"].pk]),
    "deployments:list": lambda first: reverse("deployments:list"),
    "deployments:detail": lambda first: reverse("deployments:detail", args=[first["deployments"][0].pk]),
    "deployments:run": lambda first: reverse("deployments:run", args=[first["deployments"][0].pk]),
    "deployments:stale": lambda first: reverse("deployments:stale"),
    "builds:node": lambda f: reverse("builds:node", args=[f["nodes"][0].name]),
}


def queries_per_page(client: Client, first: dict) -> dict[str, int]:
    counts = {}
    for name, url_of in PAGES.items():
        url = url_of(first)
        client.get(url)  # warm: session, content types, template caches
        with CaptureQueriesContext(connection) as captured:
            response = client.get(url)
        assert response.status_code == 200, f"{name}: {response.status_code}"
        counts[name] = len(captured.captured_queries)
    return counts


def test_page_query_counts_do_not_grow_with_ten_times_the_rows(db, tmp_path):
    admin = UserFactory(username="counting-admin", role="admin")
    client = Client()
    client.force_login(admin)
    first = add_rows(N, admin)
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama())
    profile = gguf_profile.profile_path(path)
    first["model"] = ModelFile.objects.create(
        name="tiny", node=first["nodes"][0], path=str(path), size_bytes=profile["size_bytes"], profile=profile
    )
    at_n = queries_per_page(client, first)
    add_rows(9 * N, admin, first)
    at_10n = queries_per_page(client, first)
    grown = {name: (at_n[name], at_10n[name]) for name in PAGES if at_10n[name] != at_n[name]}
    assert not grown, f"Pages whose query count changed from N={N} to 10N rows (N, 10N): {grown}"


def test_the_run_page_shows_each_steps_last_six_lines(db):
    node = NodeFactory()
    appended, bulk, empty = (Job.objects.create(kind="command", node=node) for _ in range(3))
    appended.append_lines([("out", f"a{i}") for i in range(10)])
    # Lines written without the job's counter (older rows, fixtures): still the last six.
    JobLogLine.objects.bulk_create(JobLogLine(job=bulk, seq=i, text=f"b{i}") for i in range(9))
    assert log_tails([appended, bulk, empty], 6) == {
        appended.pk: [f"a{i}" for i in range(4, 10)],
        bulk.pk: [f"b{i}" for i in range(3, 9)],
        empty.pk: [],
    }
