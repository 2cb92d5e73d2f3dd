from __future__ import annotations

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        from . import kinds

        kinds.register("command", "Command", "jobs.bodies.run_command")
