"""The Build model moved from the nodes app to its own (SeparateDatabaseAndState, then the table renamed):
every row survives the move, on the real migration graph, forwards and back, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from django.contrib.contenttypes.models import ContentType
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from builds.models import Build
from nodes.models import Node

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("nodes", "0006_rpc_tunnel"), ("builds", None)]


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


def test_builds_made_before_the_move_are_all_there_after_it():
    leaves = MigrationExecutor(connection).loader.graph.leaf_nodes()
    try:
        _migrate(BEFORE)
        old_apps = _applied_state()
        OldNode, OldBuild = old_apps.get_model("nodes", "Node"), old_apps.get_model("nodes", "Build")
        desk = OldNode.objects.create(name="desk", address="192.0.2.10")
        for version, protocol in (("b6800", "3.0.0"), ("b7100", "7.0.0")):
            OldBuild.objects.create(
                node=desk, source_kind="tarball", source=f"llama.cpp-{version}.tar.gz", version=version,
                rpc_protocol=protocol, rpc_server_path="/opt/llama/ggml-rpc-server",
                llama_server_path="/opt/llama/llama-server",
            )  # fmt: skip
        assert "nodes_build" in _tables() and "builds_build" not in _tables()
    finally:
        _migrate(leaves)
    desk = Node.objects.get(name="desk")
    rows = list(Build.objects.order_by("pk").values_list("node__name", "version", "rpc_protocol", "source"))
    assert rows == [
        ("desk", "b6800", "3.0.0", "llama.cpp-b6800.tar.gz"),
        ("desk", "b7100", "7.0.0", "llama.cpp-b7100.tar.gz"),
    ]
    assert desk.current_build.version == "b7100"
    assert "builds_build" in _tables() and "nodes_build" not in _tables()
    assert ContentType.objects.filter(app_label="builds", model="build").exists()
    assert not ContentType.objects.filter(app_label="nodes", model="build").exists()


def test_the_move_can_be_undone_with_its_rows():
    leaves = MigrationExecutor(connection).loader.graph.leaf_nodes()
    desk = Node.objects.create(name="desk", address="192.0.2.10")
    Build.objects.create(
        node=desk, source_kind="existing", version="b7100", rpc_protocol="7.0.0",
        rpc_server_path="/opt/ggml-rpc-server", llama_server_path="/opt/llama-server",
    )  # fmt: skip
    try:
        _migrate(BEFORE)
        old_apps = _applied_state()
        assert list(old_apps.get_model("nodes", "Build").objects.values_list("version", flat=True)) == [
            "b7100"
        ]
    finally:
        _migrate(leaves)
    assert list(Build.objects.values_list("version", flat=True)) == ["b7100"]
