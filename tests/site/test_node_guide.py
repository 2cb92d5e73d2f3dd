"""The README's node guide (*Preparing a node*) says what the product says: the packages the build job names,
the firewall lines the preflight prints, and the WSL2 lines a WSL node's page shows."""

from __future__ import annotations

import re

import pytest

from builds.backends import PACKAGES, packages_for
from llamacpp.rpc_reach import LINUX_FIREWALLS, firewall_fix
from nodes.probe import gpus
from nodes.probe.wsl import WindowsSide
from tests.paths import ROOT

COORDINATOR, RPC_PORT = "192.168.1.10", 50052
SECTIONS = ("AMD GPUs (ROCm/HIP)", "Intel and other GPUs (Vulkan)", "macOS", "Windows", "WSL2")


def guide() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Preparing a node\n")
    return text[start : text.index("\n## ", start + 1)]


def package_names(install: str) -> list[str]:
    """The package names in one of builds/backends.py's install lines, without its commentary."""
    command = re.sub(r"\(.*?\)", "", install)
    words = command.split()
    return [w for w in words if w not in {"sudo", "apt-get", "dnf", "pacman", "brew", "install", "-S", "or"}]


def test_the_node_guide_has_a_section_per_platform():
    headings = re.findall(r"^### (.+)$", guide(), flags=re.M)
    assert set(SECTIONS) <= set(headings)


@pytest.mark.parametrize("family", ["debian", "fedora", "arch"])
@pytest.mark.parametrize(
    "piece", ["build_tools", "vulkan_driver", "glslc", "vulkan_headers", "spirv_headers", "hip", "hipblas"]
)
def test_every_package_the_build_job_names_is_in_the_guide(piece, family):
    text = guide()
    names = package_names(packages_for(piece, family))
    assert names
    for name in names:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), f"{name} ({piece}, {family})"


def test_the_mac_lines_are_the_build_jobs():
    text = guide()
    assert packages_for("build_tools", "macos") in text and "xcode-select --install" in text
    assert PACKAGES["build_tools"]["macos"] == "cmake"


def test_the_vulkan_tools_the_probe_asks_for_are_in_the_guide():
    assert "vulkan-tools" in gpus._VULKAN_PACKAGES and "vulkan-tools" in guide()


@pytest.mark.parametrize("tool", LINUX_FIREWALLS)
def test_the_linux_firewall_lines_are_the_preflights(tool):
    assert firewall_fix("linux", COORDINATOR, RPC_PORT, tool=tool) in guide()


def test_the_windows_and_mac_firewall_lines_are_the_preflights():
    text = guide()
    assert firewall_fix("windows", COORDINATOR, RPC_PORT) in text
    assert firewall_fix("macos", "", RPC_PORT, "/path/to/ggml-rpc-server") in text


def test_the_wsl2_lines_are_the_node_pages():
    text = guide()
    side = WindowsSide(version=2, networking_mode="nat", address="", rpc_port=RPC_PORT, ssh_port=22)
    for line in (
        side.rpc_forward,
        side.rpc_firewall_rule,
        side.ssh_forward,
        side.ssh_firewall_rule,
        side.hyperv_rule,
        side.ssh_hyperv_rule,
    ):
        assert line in text, line
    assert side.wslconfig in text


def test_the_windows_build_lines_are_the_build_jobs():
    """The winget lines the Windows section gives are the ones builds/windows.py names when a piece is
    missing."""
    from builds.windows import INSTALL

    text = guide()
    for piece in ("cmake", "msvc", "ninja", "cuda", "vulkan", "git"):
        winget = INSTALL[piece][0]
        assert winget in text.replace("\n", " "), piece
