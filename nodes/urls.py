from __future__ import annotations

from django.urls import path

from . import this_machine, views

app_name = "nodes"
urlpatterns = [
    path("", views.node_list, name="list"),
    path("new/", views.node_create, name="create"),
    path("this-machine/", this_machine.add_this_machine, name="add_this_machine"),
    path("calibrate/", views.calibrate_all, name="calibrate_all"),
    path("credentials/", views.credential_list, name="credentials"),
    path("credentials/new/", views.credential_create, name="credential_create"),
    path("credentials/<int:pk>/edit/", views.credential_edit, name="credential_edit"),
    path("credentials/<int:pk>/delete/", views.credential_delete, name="credential_delete"),
    path("<slug:name>/", views.node_detail, name="detail"),
    path("<slug:name>/edit/", views.node_edit, name="edit"),
    path("<slug:name>/delete/", views.node_delete, name="delete"),
    path("<slug:name>/hardware/", views.hardware, name="hardware"),
    path("<slug:name>/probe/", views.probe_now, name="probe"),
    path("<slug:name>/calibrate/", views.calibrate_now, name="calibrate"),
    path("<slug:name>/bandwidth/", views.bandwidth_override, name="bandwidth"),
    path("<slug:name>/host-key/approve/", views.approve_host_key, name="approve_host_key"),
]
