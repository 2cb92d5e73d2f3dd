"""The ModelFile model moved from the deployments app to its own (SeparateDatabaseAndState, the foreign key
of Deployment pointed at it, then the table renamed): every row survives, a deployment keeps its model and
still protects it from deletion, on the real migration graph, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.db.models import ProtectedError

from deployments.models import Deployment
from modelfiles.models import ModelFile

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE_STATE = ("deployments", "0012_deployment_chat_answered_at")
BEFORE = [BEFORE_STATE, ("modelfiles", None)]


def _migrate(targets) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)


def _applied_state():
    """The models as every migration applied now left them (the other apps at their newest)."""
    return MigrationExecutor(connection)._create_project_state(with_applied_migrations=True).apps


def _tables() -> list[str]:
    with connection.cursor() as cursor:
        return connection.introspection.table_names(cursor)


def test_models_registered_before_the_move_are_all_there_after_it_and_still_protected(admin_user):
    leaves = MigrationExecutor(connection).loader.graph.leaf_nodes()
    try:
        _migrate(BEFORE)
        old_apps = _applied_state()
        OldNode = old_apps.get_model("nodes", "Node")
        OldModelFile = old_apps.get_model("deployments", "ModelFile")
        OldDeployment = old_apps.get_model("deployments", "Deployment")
        desk = OldNode.objects.create(name="desk", address="192.0.2.10")
        used = OldModelFile.objects.create(
            name="qwen", node=desk, path="/m/qwen.gguf", size_bytes=7, profile={"block_count": 28},
            created_by_id=admin_user.pk,
        )  # fmt: skip
        OldModelFile.objects.create(name="tiny", node=desk, path="/m/tiny.gguf", sha256="ab" * 32)
        OldDeployment.objects.create(
            name="qwen on desk", model_file=used, coordinator=desk, plan={"fits": True}
        )
        assert "deployments_modelfile" in _tables() and "modelfiles_modelfile" not in _tables()
    finally:
        _migrate(leaves)
    rows = list(ModelFile.objects.order_by("name").values_list("name", "node__name", "path", "profile"))
    assert rows == [
        ("qwen", "desk", "/m/qwen.gguf", {"block_count": 28}),
        ("tiny", "desk", "/m/tiny.gguf", {}),
    ]
    assert ModelFile.objects.get(name="tiny").sha256 == "ab" * 32
    assert ModelFile.objects.get(name="qwen").created_by == admin_user
    deployment = Deployment.objects.get()
    assert deployment.model_file.name == "qwen"
    with pytest.raises(ProtectedError):
        deployment.model_file.delete()
    assert ModelFile.objects.count() == 2
    assert "modelfiles_modelfile" in _tables() and "deployments_modelfile" not in _tables()
    assert ContentType.objects.filter(app_label="modelfiles", model="modelfile").exists()
    assert not ContentType.objects.filter(app_label="deployments", model="modelfile").exists()
