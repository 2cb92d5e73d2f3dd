from __future__ import annotations

from django.apps import AppConfig


class JobsConfig(AppConfig):
    name = "jobs"
    verbose_name = "Jobs"

    def ready(self) -> None:
        # Imported here, as Django wants: apps.py is loaded before the app registry is ready.
        from jobs import kinds
        from jobs import sockets as watchers

        kinds.register("command", "Command", "jobs.bodies.run_command")
        watchers.connect_signals()
