"""The audit model's content type follows it from jobs to audit (so the permissions and the admin role's
grant of "view audit event" stay attached), and the admin role can view the history in Django admin on a
fresh database too."""

from django.apps import apps as global_apps
from django.contrib.auth.management import create_permissions
from django.db import migrations


def forwards(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    Permission = apps.get_model("auth", "Permission")
    Group = apps.get_model("auth", "Group")
    old = ContentType.objects.filter(app_label="jobs", model="auditevent").first()
    new = ContentType.objects.filter(app_label="audit", model="auditevent").first()
    if old is not None and new is None:
        old.app_label = "audit"
        old.save(update_fields=["app_label"])
    elif old is not None:
        # Both exist (created by a post_migrate before this ran): keep the new one, carry the grants over.
        for permission in Permission.objects.filter(content_type=old):
            twin = Permission.objects.filter(content_type=new, codename=permission.codename).first()
            if twin is None:
                permission.content_type = new
                permission.save(update_fields=["content_type"])
            else:
                for group in permission.group_set.all():
                    group.permissions.add(twin)
                permission.delete()
        old.delete()
    create_permissions(global_apps.get_app_config("audit"), apps=apps, verbosity=0)
    admin = Group.objects.filter(name="admin").first()
    if admin is not None:
        admin.permissions.add(
            *Permission.objects.filter(content_type__app_label="audit", codename="view_auditevent")
        )


def backwards(apps, schema_editor):
    ContentType = apps.get_model("contenttypes", "ContentType")
    if not ContentType.objects.filter(app_label="jobs", model="auditevent").exists():
        ContentType.objects.filter(app_label="audit", model="auditevent").update(app_label="jobs")


class Migration(migrations.Migration):
    dependencies = [
        ("audit", "0002_auditevent_table"),
        ("ramdeck_site", "0002_admin_role_permissions"),
        ("contenttypes", "0002_remove_content_type_name"),
    ]
    operations = [migrations.RunPython(forwards, backwards)]
