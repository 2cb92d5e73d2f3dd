"""The audit history moves here from the jobs app, row for row: this migration only tells Django's state
that the model is now audit's (the table is the one jobs created, `jobs_auditevent`); the next one renames
the table and its index. jobs' migration 0003 drops the model from jobs' state, not from the database."""

import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("jobs", "0002_supervision"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="AuditEvent",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                            ),
                        ),
                        ("at", models.DateTimeField(db_index=True, default=django.utils.timezone.now)),
                        ("actor_name", models.CharField(blank=True, max_length=150)),
                        ("action", models.CharField(db_index=True, max_length=60)),
                        ("object_type", models.CharField(blank=True, db_index=True, max_length=60)),
                        ("object_id", models.CharField(blank=True, max_length=60)),
                        ("object_repr", models.CharField(blank=True, max_length=200)),
                        ("changes", models.JSONField(blank=True, default=dict)),
                        ("source_ip", models.GenericIPAddressField(blank=True, null=True)),
                        (
                            "actor",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                    ],
                    options={
                        "db_table": "jobs_auditevent",
                        "ordering": ["-at", "-pk"],
                        "indexes": [
                            models.Index(
                                fields=["object_type", "object_id"], name="jobs_audite_object__3f6bb0_idx"
                            )
                        ],
                        "constraints": [
                            models.CheckConstraint(
                                condition=models.Q(("action", ""), _negated=True),
                                name="audit_action_not_empty",
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
    ]
