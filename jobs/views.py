from __future__ import annotations

from django.http import HttpResponse


def audit_list(request):
    return HttpResponse("audit")
