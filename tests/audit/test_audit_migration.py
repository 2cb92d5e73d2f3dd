"""The audit history moved from the jobs app to its own (SeparateDatabaseAndState): every row survives the
move, on the real migration graph, forwards and back."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from audit.models import AuditEvent

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [("jobs", "0002_supervision"), ("audit", None)]


def _migrate(targets) -> None:
    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate(targets)


def test_audit_events_written_before_the_move_are_all_there_after_it(admin_user):
    leaves = MigrationExecutor(connection).loader.graph.leaf_nodes()
    try:
        _migrate(BEFORE)
        old_apps = MigrationExecutor(connection).loader.project_state(("jobs", "0002_supervision")).apps
        OldEvent = old_apps.get_model("jobs", "AuditEvent")
        OldEvent.objects.create(actor_id=admin_user.pk, actor_name="alice-admin", action="node.create")
        OldEvent.objects.create(action="login", changes={"user": "vera"}, source_ip="10.77.0.9")
        with connection.cursor() as cursor:
            assert "jobs_auditevent" in connection.introspection.table_names(cursor)
    finally:
        _migrate(leaves)
    events = list(
        AuditEvent.objects.order_by("pk").values_list("action", "actor_name", "changes", "source_ip")
    )
    assert events == [
        ("node.create", "alice-admin", {}, None),
        ("login", "", {"user": "vera"}, "10.77.0.9"),
    ]
    assert AuditEvent.objects.get(action="node.create").actor == admin_user
    with connection.cursor() as cursor:
        tables = connection.introspection.table_names(cursor)
    assert "audit_auditevent" in tables and "jobs_auditevent" not in tables


@pytest.mark.django_db  # before any transactional test has flushed what the migrations created
def test_the_admin_role_may_view_the_history_after_the_move(admin_user):
    from django.contrib.auth.models import Group

    assert (
        Group.objects.get(name="admin")
        .permissions.filter(content_type__app_label="audit", codename="view_auditevent")
        .exists()
    )
    assert admin_user.has_perm("audit.view_auditevent")
