from __future__ import annotations

from django.apps import AppConfig


class NodesConfig(AppConfig):
    name = "nodes"
    verbose_name = "Nodes"

    def ready(self) -> None:
        # Imported here, as Django wants: apps.py is loaded before the app registry is ready.
        from jobs import kinds
        from jobs.aio import register_node_transport
        from nodes.transports import transport_for

        register_node_transport(transport_for)
        kinds.register("probe", "Hardware probe", "nodes.probe.job.probe", queue=kinds.CONTROL)
        kinds.register("rpc_cache", "RPC cache", "nodes.cache.rpc_cache_body", queue=kinds.CONTROL)
