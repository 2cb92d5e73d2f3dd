from __future__ import annotations

from django.apps import AppConfig


class CalibrationConfig(AppConfig):
    name = "calibration"
    verbose_name = "Calibration"

    def ready(self) -> None:
        # Imported here, as Django wants: apps.py is loaded before the app registry is ready.
        from builds.job import after_recorded
        from calibration.store import calibrate_after_first_build
        from jobs import kinds

        kinds.register("calibrate", "Calibrate", "calibration.job.calibrate_body")
        # A node is calibrated by itself once its first build is recorded (compiled or an existing install).
        after_recorded(calibrate_after_first_build)
