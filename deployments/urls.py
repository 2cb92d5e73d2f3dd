from __future__ import annotations

from django.urls import path

from deployments.views import deployments, plan, run, stale

app_name = "deployments"
urlpatterns = [
    path("models/<int:pk>/plan/", plan.plan_preview, name="plan"),
    path("models/<int:pk>/plan/confirm/", plan.plan_confirm, name="confirm"),
    path("models/<int:pk>/plan/manual/", plan.plan_manual, name="manual"),
    path("deployments/", deployments.deployment_list, name="list"),
    path("deployments/<int:pk>/", deployments.deployment_detail, name="detail"),
    # The run of a deployment (deployments/views/run.py).
    path("deployments/<int:pk>/run/", run.deployment_run, name="run"),
    path("deployments/<int:pk>/processes/", run.deployment_processes, name="processes"),
    path("deployments/<int:pk>/api-key/", run.deployment_api_key, name="api_key"),
    path("deployments/<int:pk>/deploy/", run.deployment_deploy, name="deploy"),
    path("deployments/<int:pk>/stop/", run.deployment_stop, name="stop"),
    path("deployments/<int:pk>/restart/", run.deployment_restart, name="restart"),
    path("deployments/<int:pk>/recalibrate/", run.deployment_recalibrate, name="recalibrate"),
    path("deployments/<int:pk>/redeploy/", run.deployment_redeploy, name="redeploy"),
    path("deployments/<int:pk>/delete/", run.deployment_delete, name="delete"),
    path("deployments/<int:pk>/self-heal/", run.deployment_self_heal, name="self_heal"),
    path("deployments/<int:pk>/rpc-mode/", run.deployment_rpc_mode, name="rpc_mode"),
    path("stale-processes/", stale.stale_processes, name="stale"),
    path("stale-processes/<int:pk>/reap/", stale.stale_reap, name="stale_reap"),
]
