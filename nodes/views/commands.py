"""Run one command on a node, as a job of the jobs app's `command` kind with a live log."""

from __future__ import annotations

import shlex

from django import forms
from django.contrib import messages
from django.core.validators import MaxValueValidator
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from audit import history
from jobs import kinds
from jobs.models import Job
from nodes.models import Node, Transport
from ramdeck_site.roles import ADMIN, OPERATOR, can_administer, require_role, role_required


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
        required=False,
        help_text="Seconds before the command is ended. Empty: the console's default.",
    )

    def __init__(self, *args, user=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The runner stops every command job at the job time limit: a longer timeout would promise a run
        # the console never gives, so the form refuses it and says what the most is.
        limit = int(kinds.time_limit_for("command"))
        timeout = self.fields["timeout"]
        timeout.max_value = limit
        timeout.widget.attrs["max"] = limit
        timeout.validators.append(
            MaxValueValidator(
                limit,
                message=(
                    f"At most {limit} seconds: a command job is stopped at the job time limit "
                    f"({limit} s, RAMDECK_JOB_SOFT_TIME_LIMIT) whatever its own timeout says."
                ),
            )
        )
        timeout.help_text = (
            f"Seconds before the command is ended, at most {limit}. Empty: the console's default."
        )
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


@role_required(OPERATOR)
def run_command(request: HttpRequest) -> HttpResponse:
    """Run one command on a node, as a job with a live log.

    A command on a local-transport node runs as the console's own user, next to its encryption key
    and database, so it needs the admin role; the form hides those nodes from operators, and this
    check refuses them even when posted by hand.
    """
    if request.method == "POST":
        if Node.objects.filter(name=request.POST.get("node", ""), transport=Transport.LOCAL).exists():
            require_role(request, ADMIN)
        form = CommandForm(request.POST, user=request.user)
        if form.is_valid():
            node, argv = form.cleaned_data["node"], form.cleaned_data["command"]
            params = {"argv": argv}
            if form.cleaned_data["timeout"]:
                params["timeout"] = form.cleaned_data["timeout"]
            with transaction.atomic():
                job = Job.objects.create(
                    kind="command",
                    node=node,
                    title=request.POST["command"][:200],
                    params=params,
                    created_by=request.user,
                )
                history.record(
                    request, "job.create", job, changes={"kind": job.kind, "node": node.name, **params}
                )
                job.enqueue()
            messages.success(request, f"{job} queued.")
            return redirect(job)
    else:
        form = CommandForm(initial={"node": request.GET.get("node")}, user=request.user)
    return render(request, "nodes/command_form.html", {"form": form})
