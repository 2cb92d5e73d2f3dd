"""The node page's llama.cpp line says what deployments use: the node's registered build, wherever it is,
not only what the probe found on the PATH."""

from __future__ import annotations

import os
import stat

import pytest
from django.urls import reverse

from builds.models import Build, BuildSource
from jobs import runner
from jobs.models import Job, JobState
from nodes.models import Transport
from tests.factories import NodeFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.fixture
def no_llamacpp_where_the_probe_looks(tmp_path, monkeypatch, channel_layer):
    """This host as a node whose PATH and ~/.ramdeck hold no llama.cpp; the install is in a folder of its
    own (an existing install registered from the builds page)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    folder = tmp_path / "opt-llama" / "bin"
    folder.mkdir(parents=True)
    for name in ("llama-server", "ggml-rpc-server"):
        binary = folder / name
        binary.write_text("#!/bin/sh\necho 'version: 1 (test)'\n")
        binary.chmod(binary.stat().st_mode | stat.S_IEXEC)
    return folder


def test_a_registered_build_outside_the_path_is_what_the_node_page_and_the_probe_log_say(
    admin_client, no_llamacpp_where_the_probe_looks
):
    folder = no_llamacpp_where_the_probe_looks
    node = NodeFactory(name="this-box", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True)
    page = admin_client.get(reverse("nodes:detail", args=[node.name])).content.decode()
    assert "not found on this node" in page  # nothing registered, nothing probed yet

    Build.objects.create(
        node=node,
        source_kind=BuildSource.EXISTING,
        source=str(folder),
        version="b7000 (test)",
        rpc_protocol="3.0.0",
        rpc_server_path=os.path.join(folder, "ggml-rpc-server"),
        llama_server_path=os.path.join(folder, "llama-server"),
    )
    job = Job.objects.create(kind="probe", node=node, title="Probe this-box")
    runner.run_job(job.pk)
    job.refresh_from_db()
    node.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.result
    assert not node.facts.get("llama_server_binary")  # the probe itself did not see it
    log = "\n".join(job.log_lines.values_list("text", flat=True))
    assert f"llama.cpp: the registered build, {folder}/llama-server" in log
    assert "not found on this node" not in log

    page = admin_client.get(reverse("nodes:detail", args=[node.name])).content.decode()
    line = page.split('id="llamacpp-line">', 1)[1].split("</dd>", 1)[0]
    assert "not found" not in line
    assert f"{folder}/llama-server" in line and "b7000 (test)" in line and "RPC 3.0.0" in line
    # The panel htmx refreshes says the same.
    panel = admin_client.get(reverse("nodes:hardware", args=[node.name]), HTTP_HX_REQUEST="true")
    assert f"{folder}/llama-server" in panel.content.decode()


def test_an_install_the_probe_found_but_nobody_registered_says_so_and_links_to_using_it(admin_client):
    node = NodeFactory(
        name="pc2",
        facts={
            "rpc_server_binary": "/usr/local/bin/ggml-rpc-server",
            "llama_server_binary": "/usr/local/bin/llama-server",
        },
    )
    page = admin_client.get(reverse("nodes:detail", args=[node.name])).content.decode()
    line = page.split('id="llamacpp-line">', 1)[1].split("</dd>", 1)[0]
    assert "found by the probe, not yet registered" in line and "/usr/local/bin/ggml-rpc-server" in line
    assert reverse("builds:node", args=[node.name]) in line
