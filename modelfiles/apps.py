from __future__ import annotations

from django.apps import AppConfig


class ModelfilesConfig(AppConfig):
    name = "modelfiles"
    verbose_name = "Model files"

    def ready(self) -> None:
        # Imported here, as Django wants: apps.py is loaded before the app registry is ready.
        from jobs import kinds

        kinds.register("download", "Download model", "modelfiles.download.download_body")
        kinds.register("real_model", "Small real model", "modelfiles.real_model.real_model_body")
        kinds.register("model_copy", "Copy model to a node", "modelfiles.local_copy.model_copy_body")
