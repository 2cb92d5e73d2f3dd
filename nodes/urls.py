from __future__ import annotations

from django.urls import path

from nodes.views import this_machine
from nodes.views.cache import rpc_cache_clear, rpc_cache_read
from nodes.views.nodes import (
    approve_host_key,
    credential_create,
    credential_delete,
    credential_edit,
    credential_list,
    hardware,
    node_create,
    node_delete,
    node_detail,
    node_edit,
    node_list,
    probe_now,
)

app_name = "nodes"
urlpatterns = [
    path("", node_list, name="list"),
    path("new/", node_create, name="create"),
    path("this-machine/", this_machine.add_this_machine, name="add_this_machine"),
    path("credentials/", credential_list, name="credentials"),
    path("credentials/new/", credential_create, name="credential_create"),
    path("credentials/<int:pk>/edit/", credential_edit, name="credential_edit"),
    path("credentials/<int:pk>/delete/", credential_delete, name="credential_delete"),
    path("<slug:name>/", node_detail, name="detail"),
    path("<slug:name>/edit/", node_edit, name="edit"),
    path("<slug:name>/delete/", node_delete, name="delete"),
    path("<slug:name>/hardware/", hardware, name="hardware"),
    path("<slug:name>/probe/", probe_now, name="probe"),
    path("<slug:name>/rpc-cache/read/", rpc_cache_read, name="rpc_cache_read"),
    path("<slug:name>/rpc-cache/clear/", rpc_cache_clear, name="rpc_cache_clear"),
    path("<slug:name>/host-key/approve/", approve_host_key, name="approve_host_key"),
]
