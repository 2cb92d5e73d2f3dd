"""WSL2 nodes: the probe recognises them, and the node page says what the Windows side must run."""

from __future__ import annotations

import os
import subprocess

import pytest
from django.urls import reverse

from nodes.probe import parse as probe
from nodes.probe.collect import apply_probe_report
from nodes.probe.wsl import windows_side
from tests.factories import NodeFactory
from tests.probe_reports import recorded, report_of

WSL2_NAT = "linux_wsl2_ubuntu2404_nat.txt"


def test_a_wsl2_node_behind_nat_is_recognised_with_its_own_address():
    report = report_of(WSL2_NAT)
    # 10.255.255.254 (WSL's DNS tunnel, on its loopback) is listed by `hostname -I` but is no forward target.
    assert report.wsl == {"version": 2, "networking_mode": "nat", "address": "172.29.144.5"}
    assert report.os_name == "Ubuntu 24.04.1 LTS" and report.cpu_cores == 16
    assert [d.name for d in report.devices] == ["CPU", "CUDA0"]
    assert any("WSL2 behind Windows' NAT" in warning for warning in report.warnings)
    assert report.facts()["wsl"] == report.wsl


def test_a_wsl2_node_with_mirrored_networking_needs_no_forward():
    report = probe.build_report(
        recorded(WSL2_NAT).replace("networking_mode=nat", "networking_mode=mirrored"), rpc_port=50052
    )
    assert report.wsl["networking_mode"] == "mirrored"
    assert not any("NAT" in warning for warning in report.warnings)
    side = windows_side(report.wsl, rpc_port=50052, ssh_port=22)
    assert side.mirrored and not side.needs_forward
    assert "-LocalPorts 50052" in side.hyperv_rule
    assert '-VMCreatorId "{40E0AC32-46A5-438A-A0B2-2B479E8F2E90}"' in side.hyperv_rule


def test_the_wsl_kernel_without_wsl_itself_is_not_wsl():
    # A Docker Desktop container runs on WSL2's kernel but has neither /run/WSL nor WSL_INTEROP.
    text = recorded(WSL2_NAT).replace("run_wsl=yes\n", "")
    assert probe.build_report(text, rpc_port=50052).wsl == {}


def test_an_ordinary_linux_machine_is_not_wsl():
    assert report_of("linux_debian12_x86_64_headv.txt").wsl == {}
    assert report_of("linux_ubuntu_rtx3090.txt").wsl == {}


def test_wsl1_is_told_from_wsl2_by_its_kernel():
    text = recorded(WSL2_NAT).replace("5.15.167.4-microsoft-standard-WSL2", "4.4.0-19041-Microsoft")
    assert probe.build_report(text, rpc_port=50052).wsl["version"] == 1


def run_script(env: dict) -> subprocess.CompletedProcess:
    argv = ["sh", "-c", probe.PROBE_SCRIPT, "sh", "50052", ""]
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)


def test_the_probe_script_prints_the_wsl_section_on_a_wsl_kernel(tmp_path):
    """The real script, run here with `uname`, `hostname` and `wslinfo` answering as WSL2's do (the kernel
    name comes from uname; WSL_INTEROP is what a WSL session sets)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    answers = {
        "uname": "echo Linux GAMING-PC 5.15.167.4-microsoft-standard-WSL2 x86_64",
        "hostname": 'if [ "$1" = -I ]; then echo "172.29.144.5 10.255.255.254 "; else echo GAMING-PC; fi',
        "wslinfo": '[ "$1" = --networking-mode ] && echo nat',
    }
    for name, body in answers.items():
        (fake / name).write_text(f"#!/bin/sh\n{body}\n")
        (fake / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "WSL_INTEROP": "/run/WSL/1_interop"}
    result = run_script(env)
    assert result.returncode == 0, result.stderr
    report = probe.build_report(result.stdout, rpc_port=50052)
    assert report.wsl == {"version": 2, "networking_mode": "nat", "address": "172.29.144.5"}
    # Without WSL's traces the same kernel name prints nothing more.
    env.pop("WSL_INTEROP")
    plain = run_script(env)
    if not os.path.exists("/run/WSL"):
        assert probe.split_sections(plain.stdout)["wsl"] == ""


def test_the_windows_side_lines_carry_the_nodes_ports_and_only_a_real_address():
    side = windows_side(
        {"version": 2, "networking_mode": "nat", "address": "172.29.144.5"}, rpc_port=50123, ssh_port=2222
    )
    assert side.rpc_forward == (
        "netsh interface portproxy add v4tov4 listenport=50123 listenaddress=0.0.0.0 connectport=50123 "
        "connectaddress=172.29.144.5"
    )
    assert side.rpc_firewall_rule == (
        'netsh advfirewall firewall add rule name="ggml-rpc-server 50123" dir=in action=allow protocol=TCP '
        "localport=50123"
    )
    assert side.ssh_firewall_rule == (
        'netsh advfirewall firewall add rule name="RAMDeck TCP 2222" dir=in action=allow protocol=TCP '
        "localport=2222"
    )
    assert "listenport=2222" in side.ssh_forward and "connectport=2222" in side.ssh_forward
    hostile = windows_side({"version": 2, "address": "& calc.exe"}, rpc_port=50052, ssh_port=22)
    assert hostile.rpc_forward.endswith("connectaddress=<WSL address>")
    assert windows_side({}, rpc_port=50052, ssh_port=22) is None


@pytest.mark.django_db
def test_the_node_page_of_a_wsl2_node_shows_the_port_forward_for_its_rpc_port(viewer_client):
    node = NodeFactory(name="gaming-pc", rpc_port=50123)
    apply_probe_report(node, report_of(WSL2_NAT, rpc_port=50123))
    page = viewer_client.get(reverse("nodes:detail", args=[node.name])).content.decode()
    assert (
        "netsh interface portproxy add v4tov4 listenport=50123 listenaddress=0.0.0.0 connectport=50123 "
        "connectaddress=172.29.144.5"
    ) in page
    rule = "netsh advfirewall firewall add rule name=&quot;ggml-rpc-server 50123&quot; dir=in action=allow"
    assert rule in page
    assert "networkingMode=mirrored" in page and "wsl --shutdown" in page
    # The hardware panel that htmx refreshes carries it as well.
    panel = viewer_client.get(reverse("nodes:hardware", args=[node.name]), headers={"HX-Request": "true"})
    panel = panel.content.decode()
    assert 'id="wsl-port-forward"' in panel


@pytest.mark.django_db
def test_the_node_page_of_a_mirrored_wsl2_node_says_no_forward_is_needed(viewer_client):
    node = NodeFactory(name="gaming-pc")
    report = probe.build_report(
        recorded(WSL2_NAT).replace("networking_mode=nat", "networking_mode=mirrored"), rpc_port=50052
    )
    apply_probe_report(node, report)
    page = viewer_client.get(reverse("nodes:detail", args=[node.name])).content.decode()
    assert "no port forward is needed" in page and "New-NetFirewallHyperVRule" in page
    assert "portproxy add" not in page


@pytest.mark.django_db
def test_an_ordinary_node_page_has_no_wsl_advice(viewer_client):
    node = NodeFactory(name="tower")
    apply_probe_report(node, report_of("linux_ubuntu_rtx3090.txt"))
    page = viewer_client.get(reverse("nodes:detail", args=[node.name])).content.decode()
    assert "wsl-windows-side" not in page and "portproxy" not in page
