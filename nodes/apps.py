from __future__ import annotations

from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "nodes"
    verbose_name = "Nodes"

    def ready(self) -> None:
        from jobs import kinds, transport

        from .transports import transport_for

        transport.register_node_transport(transport_for)
        kinds.register("probe", "Hardware probe", "nodes.probe_job.probe", queue=kinds.CONTROL)
