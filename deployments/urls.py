from __future__ import annotations

from django.urls import path

from . import chat, lifecycle_views, views

app_name = "deployments"
urlpatterns = [
    path("models/", views.model_list, name="models"),
    path("models/register/", views.model_register, name="model_register"),
    path("models/download/", views.model_download, name="model_download"),
    path("models/<int:pk>/plan/", views.plan_preview, name="plan"),
    path("models/<int:pk>/plan/confirm/", views.plan_confirm, name="confirm"),
    path("deployments/", views.deployment_list, name="list"),
    path("deployments/<int:pk>/", views.deployment_detail, name="detail"),
    # The run of a deployment (deployments/lifecycle_views.py).
    path("deployments/<int:pk>/run/", lifecycle_views.deployment_run, name="run"),
    path("deployments/<int:pk>/processes/", lifecycle_views.deployment_processes, name="processes"),
    path("deployments/<int:pk>/api-key/", lifecycle_views.deployment_api_key, name="api_key"),
    path("deployments/<int:pk>/chat/", chat.deployment_chat, name="chat"),
    path("deployments/<int:pk>/deploy/", lifecycle_views.deployment_deploy, name="deploy"),
    path("deployments/<int:pk>/stop/", lifecycle_views.deployment_stop, name="stop"),
    path("deployments/<int:pk>/restart/", lifecycle_views.deployment_restart, name="restart"),
    path("deployments/<int:pk>/redeploy/", lifecycle_views.deployment_redeploy, name="redeploy"),
    path("deployments/<int:pk>/self-heal/", lifecycle_views.deployment_self_heal, name="self_heal"),
    path("deployments/<int:pk>/rpc-mode/", lifecycle_views.deployment_rpc_mode, name="rpc_mode"),
    path("builds/<slug:name>/", lifecycle_views.node_builds, name="node_builds"),
    path("builds/<slug:name>/start/", lifecycle_views.node_build_start, name="node_build_start"),
    path("stale-processes/", lifecycle_views.stale_processes, name="stale"),
    path("stale-processes/<int:pk>/reap/", lifecycle_views.stale_reap, name="stale_reap"),
]
