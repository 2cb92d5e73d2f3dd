from __future__ import annotations

from django.apps import AppConfig


class BuildsConfig(AppConfig):
    name = "builds"
    verbose_name = "llama.cpp builds"

    def ready(self) -> None:
        # Imported here, as Django wants: apps.py is loaded before the app registry is ready.
        from jobs import kinds

        kinds.register("build", "Build llama.cpp", "builds.job.build_body")
