"""Create the chat group: a viewer who may also chat with running deployments (ramdeck_site/roles.py)."""

from django.db import migrations


def create_chat_role(apps, schema_editor):
    apps.get_model("auth", "Group").objects.get_or_create(name="chat")


def remove_chat_role(apps, schema_editor):
    apps.get_model("auth", "Group").objects.filter(name="chat").delete()


class Migration(migrations.Migration):
    dependencies = [("ramdeck_site", "0002_admin_role_permissions")]
    operations = [migrations.RunPython(create_chat_role, remove_chat_role)]
