"""The speed-figures form: an admin's own bandwidth per device, which wins over measurements."""

from __future__ import annotations

from django import forms


class BandwidthOverrideForm(forms.Form):
    """An admin's own figure for each device of a node (GB/s); empty goes back to measured or table."""

    def __init__(self, *args, devices, **kwargs):
        super().__init__(*args, **kwargs)
        self.devices = list(devices)
        for device in self.devices:
            known = device.usable_measured_bandwidth_gbs or device.bandwidth_gbs
            self.fields[self.field_name(device)] = forms.FloatField(
                label=f"{device.name} (GB/s)",
                required=False,
                min_value=0.01,
                max_value=100_000,
                initial=device.bandwidth_override_gbs,
                help_text=(
                    f"{device.description or device.get_kind_display()}. Without an override the planner "
                    f"uses {known:g} GB/s ({device.bandwidth_source})."
                    if known
                    else f"{device.description or device.get_kind_display()}. No figure known yet."
                ),
            )

    @staticmethod
    def field_name(device) -> str:
        return f"device_{device.pk}"

    def changes(self) -> list[tuple[object, float | None, float | None]]:
        """(device, old, new) for every device whose override the form changes."""
        out = []
        for device in self.devices:
            new = self.cleaned_data.get(self.field_name(device))
            if new != device.bandwidth_override_gbs:
                out.append((device, device.bandwidth_override_gbs, new))
        return out
