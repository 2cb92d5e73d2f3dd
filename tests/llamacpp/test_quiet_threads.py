"""How the console starts llama.cpp's servers so a busy machine slows them in proportion instead of stalling
them (llamacpp/args.py): threads that sleep while they wait, as many as the node's physical cores.
benchmarks/busy_machine.py measures the difference with the real model."""

from __future__ import annotations

import pytest

from deployments.lifecycle.actions import workers_of
from deployments.models import Deployment
from llamacpp.args import (
    cpu_threads,
    llama_server_args,
    node_cpu_threads,
    quiet_argv,
    quiet_llama_server_args,
    quiet_rpc_server_args,
    rpc_server_args,
)
from llamacpp.reaper import classify, program_of
from modelfiles.models import ModelFile
from tests.factories import NodeFactory
from tests.probe_reports import report_of

SETTINGS = {"ctx": 4096, "parallel": 1, "cache_type": "f16"}


def test_llama_server_never_busy_polls_and_uses_the_nodes_physical_cores():
    args = quiet_llama_server_args(llama_server_args([], SETTINGS, 30), cpu_threads(16, threads_per_core=2))
    assert args[args.index("--poll") + 1] == "0"
    assert args[args.index("-t") + 1] == "8"
    assert args[: args.index("--poll")] == llama_server_args([], SETTINGS, 30)  # the plan's own, unchanged


def test_an_explicit_thread_count_or_polling_level_is_kept_not_doubled():
    args = quiet_llama_server_args(["-ngl", "0", "-t", "3", "--poll=20"], 8)
    assert args == ["-ngl", "0", "-t", "3", "--poll=20"]
    rpc = ["-H", "0.0.0.0", "--threads", "2"]
    assert quiet_rpc_server_args(rpc, 8) == rpc


def test_rpc_server_gets_the_nodes_cores_not_its_own_half_of_the_hardware_threads():
    assert quiet_rpc_server_args(rpc_server_args("10.0.0.9", 50052, ["CPU"]), 4)[-2:] == ["-t", "4"]


@pytest.mark.parametrize(
    ("cores", "per_core", "quota", "threads"),
    [
        (16, 2, None, 8),  # SMT: one thread per physical core
        (6, 1, None, 6),
        (2, None, None, 2),  # an older probe without the figure: every CPU counts
        (8, 2, 0.15, 1),  # a quota below a core: one thread, never more than the quota's cores
        (8, 1, 2.5, 3),
        (4, 1, 16.0, 4),  # a quota above the cores never binds
        (1, 2, None, 1),  # never fewer than one
        (0, 1, None, None),  # no probe yet: llama.cpp decides
        (None, None, None, None),
    ],
)
def test_thread_count_from_the_probed_cores(cores, per_core, quota, threads):
    assert cpu_threads(cores, threads_per_core=per_core, quota_cores=quota) == threads


def test_the_thread_count_comes_from_a_nodes_probed_facts():
    facts = {"cpu_cores": 12, "cpu_threads_per_core": 2, "cpu_quota_cores": None}
    assert node_cpu_threads(facts) == 6
    assert node_cpu_threads({}) is None and node_cpu_threads(None) is None


def test_the_servers_start_through_env_with_a_short_openmp_spin_and_are_still_recognised_as_ours():
    argv = quiet_argv(["/opt/llama/bin/llama-server", "-m", "/m.gguf", "--poll", "0"])
    assert argv[:2] == ["env", "GOMP_SPINCOUNT=200"]
    assert argv[2:] == ["/opt/llama/bin/llama-server", "-m", "/m.gguf", "--poll", "0"]
    line = " ".join(argv)
    assert program_of(line) == "llama-server" and classify(line) == "llama-server"
    assert classify(" ".join(quiet_argv(["/opt/bin/ggml-rpc-server", "-p", "50052"]))) == "rpc-server"
    assert quiet_argv(["llama-server.exe", "-m", "m.gguf"], "windows") == ["llama-server.exe", "-m", "m.gguf"]


def test_the_probe_counts_hardware_threads_per_core_on_linux_and_macos():
    assert report_of("linux_ubuntu_rtx3090.txt").cpu_threads_per_core == 2  # siblings 32, cpu cores 16
    assert report_of("linux_debian12_x86_64.txt").cpu_threads_per_core == 1
    mac = report_of("macos_m2_pro_16gb.txt")  # hw.ncpu 10, hw.physicalcpu 10: no SMT
    assert mac.cpu_threads_per_core == 1
    assert "cpu_threads_per_core" in report_of("linux_debian12_x86_64.txt").facts()


@pytest.mark.django_db
def test_a_deployments_rpc_servers_carry_their_nodes_thread_count():
    coordinator = NodeFactory(name="desk", facts={"cpu_cores": 8, "cpu_threads_per_core": 2})
    worker = NodeFactory(name="attic", facts={"cpu_cores": 4, "cpu_threads_per_core": 1})
    model = ModelFile.objects.create(name="m", node=coordinator, path="/m.gguf")
    placement = {"node": "attic", "device": "CPU", "endpoint": "10.0.0.9:50052", "layers": 4}
    deployment = Deployment.objects.create(
        name="d", model_file=model, coordinator=coordinator, plan={"placements": [placement]}
    )
    [rpc] = workers_of(deployment)
    assert rpc.node == worker and rpc.args[rpc.args.index("-t") + 1] == "4"
