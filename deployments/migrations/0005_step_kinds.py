"""Jobs of the old `launch` kind (one kind for four steps) take the kind of their step, so a verify job is
no longer labelled "Launch"."""

from django.db import migrations

KIND_OF_STEP = {
    "rpc-server": "rpc_server",
    "llama-server": "llama_server",
    "verify": "verify",
    "measure": "measure",
}


def forwards(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    for job in Job.objects.filter(kind="launch").only("pk", "params"):
        kind = KIND_OF_STEP.get((job.params or {}).get("step"))
        if kind:
            Job.objects.filter(pk=job.pk).update(kind=kind)


def backwards(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    Job.objects.filter(kind__in=list(KIND_OF_STEP.values())).update(kind="launch")


class Migration(migrations.Migration):
    dependencies = [
        ("deployments", "0004_deployment_live_status"),
        ("jobs", "0002_supervision"),
    ]

    operations = [migrations.RunPython(forwards, backwards)]
