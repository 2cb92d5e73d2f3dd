from __future__ import annotations

from django.apps import AppConfig


class CalibrationConfig(AppConfig):
    name = "calibration"
    verbose_name = "Calibration"

    def ready(self) -> None:
        # Imported here, as Django wants: apps.py is loaded before the app registry is ready.
        from jobs import kinds

        kinds.register("calibrate", "Calibrate", "calibration.job.calibrate_body")
