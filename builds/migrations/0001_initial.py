"""The Build model moves here from the nodes app, row for row: this migration only tells Django's state that
the model is now builds' (its table is still the one nodes created, `nodes_build`); nodes' migration 0007
drops it from nodes' state, not from the database, and the next migration renames the table."""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("nodes", "0006_rpc_tunnel"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="Build",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        (
                            "source_kind",
                            models.CharField(
                                choices=[
                                    ("git", "Git URL and ref"),
                                    ("tarball", "Source tarball"),
                                    ("existing", "Existing install"),
                                ],
                                max_length=10,
                            ),
                        ),
                        ("source", models.CharField(blank=True, max_length=1000)),
                        ("ref", models.CharField(blank=True, max_length=200)),
                        ("tarball_sha256", models.CharField(blank=True, max_length=64)),
                        ("backend", models.CharField(default="cpu", max_length=20)),
                        ("flags", models.JSONField(blank=True, default=list)),
                        (
                            "version",
                            models.CharField(
                                blank=True, help_text="What llama-server --version says.", max_length=200
                            ),
                        ),
                        ("rpc_binary", models.CharField(default="ggml-rpc-server", max_length=40)),
                        (
                            "rpc_protocol",
                            models.CharField(
                                blank=True, help_text="RPC protocol version, e.g. 7.0.0.", max_length=20
                            ),
                        ),
                        ("build_dir", models.CharField(blank=True, max_length=1000)),
                        ("rpc_server_path", models.CharField(max_length=1000)),
                        ("llama_server_path", models.CharField(max_length=1000)),
                        (
                            "job_id",
                            models.IntegerField(
                                blank=True, help_text="The build job that produced it.", null=True
                            ),
                        ),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        (
                            "node",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="builds",
                                to="nodes.node",
                            ),
                        ),
                    ],
                    options={"db_table": "nodes_build", "ordering": ["-created_at", "-pk"]},
                ),
            ],
            database_operations=[],
        ),
    ]
