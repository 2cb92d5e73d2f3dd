"""A build's devices come from its own rpc-server's banner, and a plan may name only those (builds/offers.py):
the plan page, Confirm and Deploy refuse any other, naming the node, the device and the build to make."""

from __future__ import annotations

import pytest
from django.urls import reverse
from django.utils import timezone

from builds.job import banner_devices
from builds.models import Build, BuildSource
from builds.offers import plan_device_refusal
from deployments.lifecycle.actions import start_deploy
from deployments.models import Deployment, DeploymentState
from jobs.models import Job, JobState
from llamacpp import gguf as gguf_profile
from llamacpp.logs import parse_rpc_banner
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from nodes.models import DeviceKind, Transport
from nodes.pool import planner_nodes
from nodes.probe.collect import apply_probe_report
from planning import planner
from tests.deploy_fixtures import lab_node, log_text, rpc_server_binary, run
from tests.factories import DeviceFactory, NodeFactory
from tests.paths import DATA
from tests.probe_reports import report_of

MIB = 2**20
PLAN = {"ctx": 1024, "parallel": 1, "cache_type": "f16", "clamp": 0.7, "full": "1"}


def banner(name: str) -> dict:
    return parse_rpc_banner((DATA / "rpc_banners" / name).read_text())


# -- banners of GPU builds (recorded; no such GPU here) ------------------------------------------------------


def test_a_rocm_builds_banner_offers_rocm0_with_its_free_memory():
    info = banner("rocm_rx7900xtx.txt")
    assert info["version"] == "7.0.0"
    assert banner_devices(info) == [
        {"name": "ROCm0", "description": "AMD Radeon RX 7900 XTX", "total_mib": 24560, "free_mib": 24462}
    ]


def test_a_vulkan_builds_banner_offers_each_gpu_as_vulkan_n_and_keeps_the_drivers_name():
    devices = banner_devices(banner("vulkan_rx7900xtx_and_igpu.txt"))
    assert [(d["name"], d["description"], d["free_mib"]) for d in devices] == [
        ("Vulkan0", "AMD Radeon RX 7900 XTX (RADV NAVI31)", 23908),
        ("Vulkan1", "AMD Radeon Graphics (RADV RAPHAEL_MENDOCINO)", 28127),
    ]


def test_a_cuda_builds_banner_on_a_lan_address_offers_cuda0_and_the_warning_is_not_a_device():
    info = banner("cuda_rtx3090_lan.txt")
    assert info["endpoint"] == "192.168.1.30:50052"
    assert [d["name"] for d in banner_devices(info)] == ["CUDA0"]


def test_a_banner_without_devices_is_not_known_rather_than_empty():
    assert banner_devices(parse_rpc_banner("Starting RPC server v3.0.0\n")) is None


@pytest.mark.django_db
def test_a_build_offers_its_banners_devices_and_the_cpu_and_unknown_stays_unknown():
    node = NodeFactory(name="pc")
    build = Build.objects.create(
        node=node, source_kind=BuildSource.EXISTING, backend="cuda", rpc_protocol="7.0.0",
        devices=banner_devices(banner("cuda_rtx3090_lan.txt")), rpc_server_path="/r", llama_server_path="/l",
    )  # fmt: skip
    assert build.offered_devices() == {"CPU", "CUDA0"}
    assert build.banner_device("CUDA0")["total_mib"] == 24135
    old = Build.objects.create(node=node, source_kind=BuildSource.EXISTING, rpc_server_path="/r",
                               llama_server_path="/l")  # fmt: skip
    assert old.offered_devices() is None


@pytest.mark.django_db
def test_a_vulkan_card_whose_memory_the_probe_could_not_read_is_planned_with_the_banners():
    node = NodeFactory(name="pc", last_seen_at=timezone.now())
    DeviceFactory(node=node, name="CPU", kind=DeviceKind.CPU, total_bytes=32 << 30, free_bytes=30 << 30)
    DeviceFactory(node=node, name="Vulkan0", kind=DeviceKind.VULKAN, total_bytes=0, free_bytes=0)
    [planned] = planner_nodes([], node)
    assert [d.total_bytes for d in planned.devices if d.name == "Vulkan0"] == [0]
    Build.objects.create(
        node=node, source_kind=BuildSource.TARBALL, backend="vulkan", rpc_protocol="7.0.0",
        devices=banner_devices(banner("vulkan_rx7900xtx_and_igpu.txt")), rpc_server_path="/r",
        llama_server_path="/l",
    )  # fmt: skip
    [planned] = planner_nodes([], node)
    vulkan = next(d for d in planned.devices if d.name == "Vulkan0")
    assert (vulkan.total_bytes, vulkan.free_bytes) == (24560 * MIB, 23908 * MIB)


def test_a_vulkan_builds_banner_on_mesas_cpu_driver_offers_llvmpipe_as_vulkan0():
    """Recorded from the Vulkan build here with GGML_VK_VISIBLE_DEVICES=0 (llama.cpp takes no CPU device
    otherwise): llvmpipe's driver offers a heap of 2048 MiB, whatever the machine's RAM."""
    info = banner("vulkan_llvmpipe.txt")
    assert info["version"] == "7.0.0"
    assert banner_devices(info) == [
        {
            "name": "Vulkan0",
            "description": "llvmpipe (LLVM 15.0.6, 256 bits)",
            "total_mib": 2048,
            "free_mib": 2048,
        }
    ]


@pytest.mark.django_db
def test_a_vulkan_device_sharing_the_ram_is_planned_with_no_more_than_its_drivers_heap_on_a_worker():
    """The probe models llvmpipe (or an integrated GPU) as all of the system's RAM; its driver offers 2048
    MiB, and a worker's rpc-server serves that device alone: the plan holds it to the driver's figure. On a
    coordinator, whose CPU uses the RAM beside it inside llama-server, the probe's figure stands."""
    desk = NodeFactory(name="desk", last_seen_at=timezone.now(), may_coordinate=True)
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=32 << 30, free_bytes=30 << 30)
    box = NodeFactory(name="mini-pc", last_seen_at=timezone.now(), may_coordinate=True)
    DeviceFactory(node=box, name="Vulkan0", kind=DeviceKind.VULKAN, total_bytes=24 << 30, free_bytes=20 << 30,
                  unified_memory=True)  # fmt: skip
    Build.objects.create(
        node=box, source_kind=BuildSource.EXISTING, backend="vulkan", rpc_protocol="7.0.0",
        devices=banner_devices(banner("vulkan_llvmpipe.txt")), rpc_server_path="/r", llama_server_path="/l",
    )  # fmt: skip
    _, worker = planner_nodes([desk, box], desk)
    [vulkan] = worker.devices
    assert (vulkan.total_bytes, vulkan.free_bytes, vulkan.unified) == (2048 * MIB, 2048 * MIB, True)
    [coordinating] = planner_nodes([box], box)
    assert coordinating.devices[0].total_bytes == 24 << 30


# -- refusals ------------------------------------------------------------------------------------------------


def _desk_and_model(tmp_path) -> tuple:
    desk = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True,
                       last_seen_at=timezone.now())  # fmt: skip
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=24 * MIB, free_bytes=24 * MIB,
                  bandwidth_gbs=2)  # fmt: skip
    Build.objects.create(node=desk, source_kind=BuildSource.EXISTING, rpc_protocol="7.0.0",
                         rpc_server_path="/r", llama_server_path="/l")  # fmt: skip
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama())
    model = ModelFile.objects.create(
        name="tiny", node=desk, path=str(path), profile=gguf_profile.profile_path(path)
    )
    return desk, model


def _plan_page(client, model) -> str:
    query = {k: v for k, v in PLAN.items() if k != "full"}
    return client.get(reverse("deployments:plan", args=[model.pk]), query).content.decode()


@pytest.mark.django_db
def test_a_plan_on_cuda0_is_confirmed_when_the_nodes_build_offers_it(tmp_path, operator_client):
    desk, model = _desk_and_model(tmp_path)
    pc = NodeFactory(name="pc", address="10.77.0.2", rtt_ms=0.3)
    apply_probe_report(pc, report_of("linux_ubuntu_rtx3090.txt"))
    Build.objects.create(
        node=pc, source_kind=BuildSource.TARBALL, backend="cuda", rpc_protocol="7.0.0",
        devices=banner_devices(banner("cuda_rtx3090_lan.txt")), rpc_server_path="/r", llama_server_path="/l",
    )  # fmt: skip
    assert "does not offer" not in _plan_page(operator_client, model)
    response = operator_client.post(
        reverse("deployments:confirm", args=[model.pk]), {**PLAN, "nodes": [desk.pk, pc.pk]}
    )
    assert response.status_code == 302
    deployment = Deployment.objects.get()
    assert any(p["device"] == "CUDA0" for p in deployment.plan["placements"])
    assert plan_device_refusal(deployment.plan) == ""


@pytest.mark.lab
@pytest.mark.llamacpp
@pytest.mark.timeout(180)
@pytest.mark.django_db(transaction=True)
def test_the_real_cpu_build_on_a_node_with_a_cuda_gpu_is_refused_at_the_plan_confirm_and_deploy(
    lab, lab_host, tmp_path, operator_client, operator_user
):
    """The real CPU-only llama.cpp build is registered on a lab host whose probe found an RTX 3090: its
    rpc-server's own banner lists the CPU alone, so a plan on CUDA0 is refused before anything starts."""
    desk, model = _desk_and_model(tmp_path)
    node = lab_node(lab, lab_host)
    apply_probe_report(node, report_of("linux_ubuntu_rtx3090.txt"))
    job = run(
        Job.objects.create(
            kind="build", node=node, params={"source": "existing", "path": str(rpc_server_binary().parent)}
        )
    )
    assert job.state == JobState.SUCCEEDED, (job.result, log_text(job))
    build = Build.objects.get(node=node)
    assert [d["name"] for d in build.devices] == ["CPU"]  # what the real rpc-server printed
    assert build.devices[0]["total_mib"] > 0 and build.devices[0]["free_mib"] > 0
    assert "its rpc-server offers CPU (" in log_text(job)
    expected = (
        f"{node.name}'s llama.cpp build #{build.pk} (cpu) does not offer CUDA0: its rpc-server lists CPU. "
        f"Build llama.cpp with the CUDA backend on {node.name} (its Builds page), then plan again."
    )

    page = _plan_page(operator_client, model)
    assert expected.replace("'", "&#x27;") in page
    assert 'id="confirm-plan" type="submit" form="confirm-form" disabled' in page

    response = operator_client.post(
        reverse("deployments:confirm", args=[model.pk]), {**PLAN, "nodes": [desk.pk, node.pk]}
    )
    assert response.status_code == 409
    assert expected.replace("'", "&#x27;") in response.content.decode()
    assert not Deployment.objects.exists()

    # A plan confirmed before (a build replaced since, say) is refused at Deploy with the same words.
    plan = planner.plan(model.profile, planner_nodes([node], desk), planner.Settings(ctx=1024))
    assert any(p["device"] == "CUDA0" for p in plan["placements"])
    deployment = Deployment.objects.create(
        name="tiny", model_file=model, coordinator=desk, plan=plan, created_by=operator_user
    )
    started, reason = start_deploy(deployment, operator_user)
    assert (started, reason) == (False, expected)
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.CONFIRMED
    assert not Job.objects.filter(kind="deploy").exists()


def test_an_existing_installs_backend_is_what_its_banner_serves():
    from builds.job import backend_of

    assert backend_of(banner_devices(banner("rocm_rx7900xtx.txt"))) == "rocm"
    assert backend_of(banner_devices(banner("vulkan_rx7900xtx_and_igpu.txt"))) == "vulkan"
    assert backend_of(banner_devices(banner("cuda_rtx3090_lan.txt"))) == "cuda"
    assert backend_of([{"name": "CPU"}]) == "cpu"


@pytest.mark.django_db
def test_the_builds_page_shows_what_each_build_offers(operator_client):
    node = NodeFactory(name="pc")
    Build.objects.create(node=node, source_kind=BuildSource.EXISTING, rpc_server_path="/r",
                         llama_server_path="/l")  # fmt: skip
    Build.objects.create(
        node=node, source_kind=BuildSource.TARBALL, backend="rocm", rpc_protocol="7.0.0",
        devices=banner_devices(banner("rocm_rx7900xtx.txt")), rpc_server_path="/r", llama_server_path="/l",
    )  # fmt: skip
    page = operator_client.get(reverse("builds:node", args=[node.name])).content.decode()
    assert "Devices it offers" in page
    assert '<span class="mono">ROCm0</span> AMD Radeon RX 7900 XTX (24462 of 24560 MiB free)' in page
    assert "not known (its banner listed none)" in page
