"""When the console lost contact with a node. A node already unreachable counts as offline since its last
probe, so the first failure after the upgrade does not announce an outage that began before it."""

from django.db import migrations, models
from django.db.models import F


def offline_since_last_probe(apps, schema_editor):
    Node = apps.get_model("nodes", "Node")
    Node.objects.filter(reachability="unreachable", last_probe_at__isnull=False).update(
        unreachable_since=F("last_probe_at")
    )


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0007_build_moves_to_builds"),
    ]

    operations = [
        migrations.AddField(
            model_name="node",
            name="unreachable_since",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.RunPython(offline_since_last_probe, migrations.RunPython.noop),
    ]
