from __future__ import annotations

from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Deployments"

    def ready(self) -> None:
        # Imported here, as Django wants: apps.py is loaded before the app registry is ready.
        from jobs import kinds

        steps = "deployments.steps"
        runs = "deployments.lifecycle.runs"
        # A deployment's runs: their bodies run the steps below as child jobs and open no connection.
        kinds.register(
            "deploy", "Deploy", f"{runs}.deploy_body", needs_transport=False, on_end=f"{runs}.deploy_ended"
        )
        kinds.register(
            "heal",
            "Self-heal",
            "deployments.lifecycle.healing.heal_body",
            needs_transport=False,
            on_end=f"{runs}.deploy_ended",
        )
        kinds.register(
            "undeploy",
            "Stop deployment",
            f"{runs}.undeploy_body",
            queue=kinds.CONTROL,
            needs_transport=False,
            on_end=f"{runs}.undeploy_ended",
        )
        kinds.register(
            "recalibrate",
            "Stop, calibrate, start again",
            f"{runs}.recalibrate_body",
            needs_transport=False,
            on_end=f"{runs}.recalibrate_ended",
        )
        # The steps. A lost rpc_server or llama_server step leaves its daemon running (adopted): the
        # rollback that follows ends it by the PID the deployment recorded, after checking it is still ours.
        kinds.register("reap", "Reap stale processes", f"{steps}.reap.reap_body", queue=kinds.CONTROL)
        kinds.register(
            "rpc_server", "Start ggml-rpc-server", f"{steps}.rpc_server.rpc_server_body", adopt_on_loss=True
        )
        kinds.register(
            "rpc_tunnel",
            "Start RPC tunnel",
            f"{steps}.rpc_tunnel.rpc_tunnel_body",
            adopt_on_loss=True,
        )
        kinds.register(
            "preflight", "Check the coordinator reaches its workers", f"{steps}.preflight.preflight_body"
        )
        kinds.register(
            "llama_server",
            "Start llama-server",
            f"{steps}.llama_server.llama_server_body",
            adopt_on_loss=True,
        )
        kinds.register("verify", "Verify placement", f"{steps}.checks.verify_body")
        kinds.register("measure", "Measure speed", f"{steps}.checks.measure_body")
        kinds.register("stop", "Stop processes", f"{steps}.stop.stop_body", queue=kinds.CONTROL)
