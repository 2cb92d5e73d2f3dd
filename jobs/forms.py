"""Forms of the job pages: the job list's filters and the "run a command" form."""

from __future__ import annotations

import shlex

from django import forms

from nodes.models import Node, Transport
from ramdeck_site.roles import can_administer

from .models import JobKind, JobState


class JobFilterForm(forms.Form):
    state = forms.ChoiceField(choices=[("", "Any state"), *JobState.choices], required=False)
    kind = forms.ChoiceField(choices=[("", "Any kind"), *JobKind.choices], required=False)
    node = forms.ModelChoiceField(
        queryset=Node.objects.all(), to_field_name="name", required=False, empty_label="Any node"
    )


class CommandForm(forms.Form):
    node = forms.ModelChoiceField(queryset=Node.objects.filter(enabled=True), to_field_name="name")
    command = forms.CharField(
        max_length=2000,
        widget=forms.TextInput(attrs={"class": "mono", "autocomplete": "off", "spellcheck": "false"}),
        help_text=(
            "Typed as in a shell and split the same way (quotes work), but not run by a shell: no pipes, "
            "redirects or variables. It is kept in the job history, so never put a password in it."
        ),
    )
    timeout = forms.IntegerField(
        min_value=1,
        max_value=86400,
        required=False,
        help_text="Seconds before the command is ended. Empty: the console's default.",
    )

    def __init__(self, *args, user=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # A command on the console's own host runs as the console's user and can read its secrets
        # (the encryption key, the database): only admins get those nodes. The view checks it too.
        if not can_administer(user):
            self.fields["node"].queryset = self.fields["node"].queryset.filter(transport=Transport.SSH)

    def clean_command(self) -> list[str]:
        line = self.cleaned_data["command"]
        try:
            argv = shlex.split(line)
        except ValueError as exc:
            raise forms.ValidationError(f"This line cannot be split into arguments ({exc}).") from exc
        if not argv:
            raise forms.ValidationError("Enter a command.")
        if "\x00" in line:
            raise forms.ValidationError("The command contains a NUL character.")
        return argv
