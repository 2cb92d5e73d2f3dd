"""Give the admin role the permissions Django admin needs to manage users and roles."""

from django.apps import apps as global_apps
from django.contrib.auth.management import create_permissions
from django.db import migrations

CODENAMES = [
    f"{action}_{model}" for action in ("add", "change", "delete", "view") for model in ("user", "group")
]


def grant(apps, schema_editor):
    # Permissions are normally created after all migrations; create auth's now so they can be granted.
    for label in ("auth", "jobs"):
        create_permissions(global_apps.get_app_config(label), apps=apps, verbosity=0)
    Group = apps.get_model("auth", "Group")
    Permission = apps.get_model("auth", "Permission")
    admin = Group.objects.get(name="admin")
    admin.permissions.add(*Permission.objects.filter(content_type__app_label="auth", codename__in=CODENAMES))
    # Viewing the audit history in Django admin (its admin is read-only regardless).
    viewer_perms = Permission.objects.filter(content_type__app_label="jobs", codename="view_auditevent")
    admin.permissions.add(*viewer_perms)


class Migration(migrations.Migration):
    dependencies = [
        ("ramdeck_site", "0001_roles"),
        ("auth", "0012_alter_user_first_name_max_length"),
        ("jobs", "0001_initial"),
    ]
    operations = [migrations.RunPython(grant, migrations.RunPython.noop)]
