"""The command lines a plan or a deployment runs, for the plan and deployment pages: built by the same
functions the deploy steps start the processes with (llamacpp/args.py `llama_server_launch_argv`,
llamacpp/rpc_cache.py `launch_argv`), so what a page shows is what runs."""

from __future__ import annotations

from deployments.endpoint import bind_host, default_port, default_reach, host_for
from deployments.lifecycle import actions as lifecycle
from deployments.models import Deployment
from llamacpp import rpc_cache, rpc_guard
from llamacpp.args import llama_server_launch_argv, node_cpu_threads, quiet_rpc_server_args
from modelfiles.models import ModelFile
from nodes.models import Node
from remote.base import shell_join


def command_lines(model: ModelFile, plan: dict, deployment: Deployment | None = None) -> dict:
    """The command lines the launch runs for this plan, built by the functions the deploy steps use
    (llamacpp/args.py): the environment, `--poll 0` and `-t` included. Before a deployment exists its
    endpoint is the coordinator's default choice; the API key's file is named as the launch names it, in
    the node's ~/.ramdeck/run (read on the node at launch). In tunnel mode the launch points --rpc at the
    tunnels' local ends, which exist only then."""
    coordinator = (
        deployment.coordinator
        if deployment is not None
        else Node.objects.filter(name=plan["coordinator"]).first()
    )
    build = coordinator.current_build if coordinator is not None else None
    if deployment is not None:
        host, port = bind_host(deployment), deployment.port
    elif coordinator is not None:
        host, port = host_for(coordinator, default_reach(coordinator)), default_port(coordinator)
    else:
        host, port = "127.0.0.1", 8080
    node_name = coordinator.name if coordinator is not None else plan["coordinator"]
    number = deployment.pk if deployment is not None else "N"
    key_file = f"~/.ramdeck/run/d{number}-{node_name}-llama-server-{port}.key"
    if deployment is not None:
        key_file = next(
            (p["key_file"] for p in (deployment.processes or {}).values() if p.get("key_file")), key_file
        )
    argv = llama_server_launch_argv(
        build.llama_server_path if build is not None else "llama-server",
        model.path,
        plan["llama_server_args"],
        threads=node_cpu_threads(coordinator.facts) if coordinator is not None else None,
        alias=model.name,
        host=host,
        port=port,
        key_file=key_file,
        platform=coordinator.platform if coordinator is not None else "linux",
    )
    return {"llama_server": shell_join(argv), "rpc_servers": _rpc_command_lines(plan, deployment)}


def _rpc_command_lines(plan: dict, deployment: Deployment | None) -> list[dict]:
    """Each worker's ggml-rpc-server command line as the rpc_server step starts it (rpc_cache.launch_argv):
    for a deployment, with the arguments its run gives the step (threads, and where it binds in its RPC
    mode); before one exists, the plan's arguments with the node's threads."""
    if deployment is not None:
        workers = lifecycle.workers_of(deployment)
        mode = lifecycle.rpc_mode(deployment, workers)
        servers = []
        for worker in workers:
            try:
                bind = lifecycle.worker_bind(worker, mode, deployment.coordinator)
            except rpc_guard.BindRefused:
                bind = worker.node.rpc_bind_host  # Deploy refuses it, saying why
            servers.append((worker.node.name, worker.node, lifecycle.with_bind(worker.args, bind)))
    else:
        nodes = {n.name: n for n in Node.objects.filter(name__in=[s["node"] for s in plan["rpc_servers"]])}
        servers = []
        for server in plan["rpc_servers"]:
            node = nodes.get(server["node"])
            threads = node_cpu_threads(node.facts) if node is not None else None
            servers.append((server["node"], node, quiet_rpc_server_args(server["args"], threads)))
    out = []
    for name, node, args in servers:
        build = node.current_build if node is not None else None
        argv = rpc_cache.launch_argv(
            build.rpc_server_path if build is not None else "ggml-rpc-server",
            args,
            limit_gib=node.rpc_cache_limit_gib if node is not None else 0,
            folder=node.llama_cache_dir if node is not None else "",
            platform=node.platform if node is not None else "linux",
        )
        out.append({"node": name, "command": shell_join(argv)})
    return out
