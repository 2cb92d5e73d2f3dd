"""deployments 0012 adds `chat_answered_at` (the first-run checklist's last tick) and keeps a console that
had finished its checklist finished: a deployment whose measure step got tokens back counted as answered
before."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from deployments.models import Deployment
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("deployments", "0011_rpc_tunnel")]


def _migrate(targets) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)


def test_measured_deployments_count_as_answered_and_the_others_do_not():
    leaves = MigrationExecutor(connection).loader.graph.leaf_nodes()
    running_at = timezone.now().replace(microsecond=0)
    try:
        _migrate(BEFORE)
        old_apps = MigrationExecutor(connection).loader.project_state(BEFORE[0]).apps
        OldDeployment = old_apps.get_model("deployments", "Deployment")
        OldModelFile = old_apps.get_model("deployments", "ModelFile")
        node_id = NodeFactory(name="box").pk
        model = OldModelFile.objects.create(name="tiny", node_id=node_id, path="/m/tiny.gguf")
        common = {"model_file": model, "coordinator_id": node_id, "plan": {}, "port": 8080}
        OldDeployment.objects.create(
            name="measured", measured_decode_tps=30.0, running_at=running_at, **common
        )
        OldDeployment.objects.create(name="never ran", **common)
    finally:
        _migrate(leaves)
    answered = dict(Deployment.objects.values_list("name", "chat_answered_at"))
    assert answered == {"measured": running_at, "never ran": None}
