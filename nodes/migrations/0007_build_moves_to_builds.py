"""Build now belongs to the builds app (builds/migrations/0001): gone from nodes' state, its table kept."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0006_rpc_tunnel"),
        ("builds", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="Build")],
            database_operations=[],
        ),
    ]
