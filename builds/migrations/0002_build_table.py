"""The moved Build model gets the builds app's table name, and its content type follows it (so any
permission granted on it stays attached)."""

from django.db import migrations


def move_content_type(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if not ContentType.objects.filter(app_label="builds", model="build").exists():
        ContentType.objects.filter(app_label="nodes", model="build").update(app_label="builds")


def move_content_type_back(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if not ContentType.objects.filter(app_label="nodes", model="build").exists():
        ContentType.objects.filter(app_label="builds", model="build").update(app_label="nodes")


class Migration(migrations.Migration):
    dependencies = [
        ("builds", "0001_initial"),
        ("nodes", "0007_build_moves_to_builds"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.AlterModelTable(name="build", table=None),
        migrations.RunPython(move_content_type, move_content_type_back),
    ]
