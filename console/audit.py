"""The audit history page: read-only, filterable, paginated."""

from __future__ import annotations

from datetime import datetime, time

from django import forms
from django.contrib.auth import get_user_model
from django.core.paginator import Paginator
from django.db.models import Q
from django.shortcuts import render
from django.utils import timezone

from audit.models import AuditEvent
from ramdeck_site.roles import VIEWER, role_required

PAGE_SIZE = 50


class AuditFilterForm(forms.Form):
    actor = forms.CharField(required=False, label="Actor")
    action = forms.CharField(required=False, label="Action")
    object = forms.CharField(required=False, label="Object")
    since = forms.DateField(required=False, label="From", widget=forms.DateInput(attrs={"type": "date"}))
    until = forms.DateField(required=False, label="To", widget=forms.DateInput(attrs={"type": "date"}))

    def clean(self):
        cleaned = super().clean()
        since, until = cleaned.get("since"), cleaned.get("until")
        if since and until and since > until:
            self.add_error("until", "The end date is before the start date.")
        return cleaned


def _day_bound(day, end: bool):
    moment = datetime.combine(day, time.max if end else time.min)
    return timezone.make_aware(moment, timezone.get_current_timezone())


def filter_events(form: AuditFilterForm):
    events = AuditEvent.objects.all()
    if not form.is_valid():
        return events.none() if form.errors else events
    data = form.cleaned_data
    if data["actor"]:
        events = events.filter(actor_name__icontains=data["actor"].strip())
    if data["action"]:
        events = events.filter(action__icontains=data["action"].strip())
    if data["object"]:
        term = data["object"].strip()
        events = events.filter(
            Q(object_repr__icontains=term) | Q(object_type__iexact=term) | Q(object_id=term)
        )
    if data["since"]:
        events = events.filter(at__gte=_day_bound(data["since"], end=False))
    if data["until"]:
        events = events.filter(at__lte=_day_bound(data["until"], end=True))
    return events


@role_required(VIEWER)
def audit_list(request):
    form = AuditFilterForm(request.GET or None)
    page = Paginator(filter_events(form), PAGE_SIZE).get_page(request.GET.get("page"))
    query = request.GET.copy()
    query.pop("page", None)
    template = "console/audit_list.html"
    if request.htmx and request.htmx.target == "audit-table":
        template += "#table"
    context = {
        "form": form,
        "page": page,
        "query": query.urlencode(),
        "actors": get_user_model().objects.order_by("username").values_list("username", flat=True),
    }
    return render(request, template, context)
