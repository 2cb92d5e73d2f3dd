from __future__ import annotations

from django.http import HttpResponse


def _stub(request, *args, **kwargs):
    return HttpResponse("stub")


node_list = node_create = credential_list = credential_create = credential_delete = _stub
node_detail = node_edit = node_delete = _stub
