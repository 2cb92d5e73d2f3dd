"""The moved ModelFile model gets the modelfiles app's table name, and its content type follows it."""

from django.db import migrations


def move_content_type(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if not ContentType.objects.filter(app_label="modelfiles", model="modelfile").exists():
        ContentType.objects.filter(app_label="deployments", model="modelfile").update(app_label="modelfiles")


def move_content_type_back(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if not ContentType.objects.filter(app_label="deployments", model="modelfile").exists():
        ContentType.objects.filter(app_label="modelfiles", model="modelfile").update(app_label="deployments")


class Migration(migrations.Migration):
    dependencies = [
        ("modelfiles", "0001_initial"),
        ("deployments", "0013_modelfile_moves_to_modelfiles"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]

    operations = [
        migrations.AlterModelTable(name="modelfile", table=None),
        migrations.RunPython(move_content_type, move_content_type_back),
    ]
