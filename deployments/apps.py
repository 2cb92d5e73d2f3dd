from __future__ import annotations

from django.apps import AppConfig


class DeploymentsConfig(AppConfig):
    name = "deployments"
    verbose_name = "Models and deployments"

    def ready(self) -> None:
        from jobs import kinds

        kinds.register("build", "Build llama.cpp", "deployments.build_job.build_body")
        kinds.register("download", "Download model", "deployments.download_job.download_body")
        kinds.register(
            "reap", "Reap stale processes", "deployments.lifecycle_steps.reap_body", queue=kinds.CONTROL
        )
        kinds.register("launch", "Launch", "deployments.lifecycle_steps.launch_body", adopt_on_loss=True)
        kinds.register("stop", "Stop", "deployments.lifecycle_steps.stop_body", queue=kinds.CONTROL)
