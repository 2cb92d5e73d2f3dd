"""AuditEvent now belongs to the audit app (audit/migrations/0001_initial.py): gone from jobs' state only;
the table and every row stay."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("jobs", "0002_supervision"),
        ("audit", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[migrations.DeleteModel(name="AuditEvent")],
            database_operations=[],
        ),
    ]
