"""The ModelFile model moves here from the deployments app, row for row: this migration only tells Django's
state that the model is now modelfiles' (its table is still `deployments_modelfile`); deployments' migration
0013 points Deployment.model_file at it and drops it from deployments' state, and the next migration renames
the table."""

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("nodes", "0006_rpc_tunnel"),
        ("deployments", "0012_deployment_chat_answered_at"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="ModelFile",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("name", models.CharField(max_length=200, unique=True)),
                        (
                            "path",
                            models.CharField(
                                help_text="Path of the (first) GGUF file on the node.", max_length=1000
                            ),
                        ),
                        (
                            "shard_paths",
                            models.JSONField(
                                blank=True, default=list, help_text="Every shard, first included."
                            ),
                        ),
                        ("size_bytes", models.BigIntegerField(default=0)),
                        ("sha256", models.CharField(blank=True, max_length=64)),
                        ("profile", models.JSONField(default=dict)),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        (
                            "created_by",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                        (
                            "node",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="model_files",
                                to="nodes.node",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "deployments_modelfile",
                        "ordering": ["name"],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("node", "path"), name="unique_model_path_per_node"
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
