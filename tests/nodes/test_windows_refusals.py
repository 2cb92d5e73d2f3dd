"""What a Windows node cannot do yet is refused with a sentence before anything is sent to it (the commands
of these features are POSIX sh): calibration. Its RPC cache is managed as a POSIX node's (in PowerShell)."""

from __future__ import annotations

import asyncio

import pytest

from builds.checks import source_problems
from calibration.store import refusal as calibration_refusal
from jobs.models import Job
from nodes import cache
from tests.factories import NodeFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def windows_pc():
    return NodeFactory(name="gaming-pc", platform_hint="windows")


def test_calibration_says_why_not_on_windows_and_the_rpc_cache_is_not_refused(windows_pc):
    assert calibration_refusal(windows_pc) == (
        "gaming-pc runs Windows, where calibration is not built yet: its figures come from the table."
    )
    assert cache.refusal(windows_pc) == ""


def test_the_build_form_leaves_a_windows_source_build_and_install_folder_to_the_job(windows_pc):
    """Nothing is sent to the node from the form: the build job checks CMake, the compiler, tar and git, or
    the folder, in PowerShell itself and names what is missing (builds/windows.py)."""
    for params in (
        {"source": "tarball"},
        {"source": "git", "git_url": "x", "git_ref": "y"},
        {"source": "existing", "path": "C:\\llama"},
    ):
        assert asyncio.run(source_problems(windows_pc, params)) == {}


def test_the_node_page_offers_the_rpc_cache_buttons_on_windows(windows_pc, admin_client):
    page = admin_client.get(windows_pc.get_absolute_url()).content.decode()
    panel = page.split('id="rpc-cache"', 1)[1].split('id="node-jobs"', 1)[0]
    assert "Read again" in panel and "Clear" in panel
    response = admin_client.post(f"/nodes/{windows_pc.name}/rpc-cache/read/")
    job = Job.objects.get(node=windows_pc, kind=cache.KIND)
    assert response.status_code == 302 and job.params == {"action": "usage"}
