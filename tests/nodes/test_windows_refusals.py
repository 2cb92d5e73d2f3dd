"""What a Windows node cannot do yet is refused with a sentence before anything is sent to it (the commands
of these features are POSIX sh): calibration, the RPC cache."""

from __future__ import annotations

import asyncio

import pytest

from builds.checks import source_problems
from calibration.store import refusal as calibration_refusal
from nodes import cache
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def windows_pc():
    return NodeFactory(name="gaming-pc", platform_hint="windows")


def test_calibration_and_the_rpc_cache_say_why_not_on_windows(windows_pc):
    assert calibration_refusal(windows_pc) == (
        "gaming-pc runs Windows, where calibration is not built yet: its figures come from the table."
    )
    assert (
        cache.refusal(windows_pc)
        == "gaming-pc runs Windows, whose rpc-server runs without the RPC cache for now."
    )


def test_the_build_form_leaves_a_windows_source_build_and_install_folder_to_the_job(windows_pc):
    """Nothing is sent to the node from the form: the build job checks CMake, the compiler, tar and git, or
    the folder, in PowerShell itself and names what is missing (builds/windows.py)."""
    for params in (
        {"source": "tarball"},
        {"source": "git", "git_url": "x", "git_ref": "y"},
        {"source": "existing", "path": "C:\\llama"},
    ):
        assert asyncio.run(source_problems(windows_pc, params)) == {}


def test_the_node_page_offers_no_rpc_cache_buttons_on_windows(windows_pc, admin_client):
    page = admin_client.get(windows_pc.get_absolute_url()).content.decode()
    panel = page.split('id="rpc-cache"', 1)[1].split("</div>", 1)[0]
    assert "without its cache for now" in panel and "Clear" not in panel
    response = admin_client.post(f"/nodes/{windows_pc.name}/rpc-cache/read/", follow=True)
    assert "whose rpc-server runs without the RPC cache for now" in response.content.decode()
