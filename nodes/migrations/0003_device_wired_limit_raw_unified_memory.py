"""Unified-memory devices store the Mac's raw memory and its wired limit; the planner clamps once.

Before this, the probe stored the usable share as an MTL0 row's total and free memory: the wired limit
when an operator had set one, else int(RAM x clamp) with the clamp of RAMDECK_UNIFIED_MEMORY_CLAMP
(0.70 by default), and the planner applied the clamp a second time. Rows probed that way are rewritten
so that a plan made before their next probe is clamped exactly once:

- total and free become the Mac's RAM (the node's facts recorded it as ram_total_bytes);
- when the old figure is 70% of that RAM, it was the default clamp: no wired limit is recorded, and the
  planner's clamp gives the same share again;
- any other old figure was either a wired limit (recorded as one, which is what it was) or a clamp that
  an operator had changed. Recording such a share as a limit keeps plans within it, never above it,
  until the next probe stores the true wired limit (the probe runs every few minutes).

A row whose node has no recorded RAM falls back to old / 0.70 as its RAM, the default's inverse. Going
back restores the old meaning: the usable share as total and free.
"""

from django.db import migrations, models

# The old probe's default clamp, fixed here on purpose: it describes rows written in the past, whatever
# the default is today.
OLD_DEFAULT_CLAMP = 0.70
MIB = 1024 * 1024


def raw_memory(apps, schema_editor):
    Device = apps.get_model("nodes", "Device")
    for device in Device.objects.filter(unified_memory=True).select_related("node"):
        old = device.total_bytes
        facts = device.node.facts if isinstance(device.node.facts, dict) else {}
        ram = int(facts.get("ram_total_bytes") or 0) or round(old / OLD_DEFAULT_CLAMP)
        ram = max(ram, old)
        default_share = abs(old - int(ram * OLD_DEFAULT_CLAMP)) <= MIB
        device.total_bytes = device.free_bytes = ram
        device.wired_limit_bytes = None if default_share else old
        device.save(update_fields=["total_bytes", "free_bytes", "wired_limit_bytes"])


def usable_share(apps, schema_editor):
    Device = apps.get_model("nodes", "Device")
    for device in Device.objects.filter(unified_memory=True):
        share = int(device.total_bytes * OLD_DEFAULT_CLAMP)
        if device.wired_limit_bytes:
            share = device.wired_limit_bytes
        device.total_bytes = device.free_bytes = share
        device.save(update_fields=["total_bytes", "free_bytes"])


class Migration(migrations.Migration):
    dependencies = [
        ("nodes", "0002_build"),
    ]

    operations = [
        migrations.AddField(
            model_name="device",
            name="wired_limit_bytes",
            field=models.BigIntegerField(
                blank=True,
                help_text="Metal's wired limit when an operator set one (sysctl iogpu.wired_limit_mb); "
                "empty: macOS's default.",
                null=True,
            ),
        ),
        migrations.RunPython(raw_memory, usable_share),
    ]
