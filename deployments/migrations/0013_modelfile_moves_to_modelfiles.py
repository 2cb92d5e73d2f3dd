"""ModelFile now belongs to the modelfiles app (modelfiles/migrations/0001): Deployment.model_file points at
it there, and it is gone from deployments' state. Nothing changes in the database: the column and its
constraint already point at the same table."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0012_deployment_chat_answered_at"),
        ("modelfiles", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="deployment",
                    name="model_file",
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="deployments",
                        to="modelfiles.modelfile",
                    ),
                ),
                migrations.DeleteModel(name="ModelFile"),
            ],
            database_operations=[],
        ),
    ]
