"""The job list's filters."""

from __future__ import annotations

from django import forms

from jobs import kinds
from jobs.models import Job, JobState


def _node_choices() -> list[tuple[str, str]]:
    # The jobs' own copy of the node name: the list filters the history, including nodes since deleted.
    names = Job.objects.exclude(node_name="").order_by("node_name").values_list("node_name", flat=True)
    return [("", "Any node"), *((name, name) for name in names.distinct())]


class JobFilterForm(forms.Form):
    state = forms.ChoiceField(choices=[("", "Any state"), *JobState.choices], required=False)
    kind = forms.ChoiceField(choices=lambda: [("", "Any kind"), *kinds.choices()], required=False)
    node = forms.ChoiceField(choices=_node_choices, required=False)
