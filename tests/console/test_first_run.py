"""The first-run path: the dashboard's checklist, "Add this machine", the detected llama.cpp install, the
same machine refused twice, generated SSH key pairs, and host keys that need approval (not errors)."""

from __future__ import annotations

import asyncssh
import pytest
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEvent
from builds.models import Build
from console.first_run import FirstRunState, checklist, gather_state
from deployments.models import Deployment
from jobs.models import Job, JobState
from modelfiles.models import ModelFile
from nodes.models import Credential, Node, Transport
from tests.factories import CredentialFactory, NodeFactory

pytestmark = pytest.mark.django_db

BIN = "/opt/llama/bin"


def done(state: FirstRunState) -> dict[str, bool]:
    return {step.key: step.done for step in checklist(state)}


def test_an_empty_console_has_every_step_to_do_and_offers_this_machine_first():
    steps = checklist(FirstRunState())
    assert [s.key for s in steps] == [
        "credential", "node", "host_key", "probe", "build", "calibrated", "model", "plan", "deploy", "chat"
    ]  # fmt: skip
    assert not any(s.done for s in steps)
    assert steps[0].post and steps[0].url == reverse("nodes:add_this_machine")


def test_this_machine_counts_as_the_way_in_and_needs_no_host_key():
    state = FirstRunState(has_local_node=True, has_node=True, has_trusted_node=True, first_node="box")
    ticks = done(state)
    assert ticks["credential"] and ticks["node"] and ticks["host_key"]
    assert not ticks["probe"]
    assert checklist(state)[3].url == reverse("nodes:detail", args=["box"])


def test_a_key_awaiting_approval_links_to_its_node_and_is_not_done():
    state = FirstRunState(has_credential=True, has_node=True, node_awaiting_key="attic")
    step = checklist(state)[2]
    assert not step.done and step.url == reverse("nodes:detail", args=["attic"])
    # One trusted node is enough to go on: a second machine's key shows under "Needs attention" instead.
    assert checklist(FirstRunState(has_trusted_node=True, node_awaiting_key="attic"))[2].done


def test_the_state_comes_from_the_database(admin_user):
    assert gather_state() == FirstRunState()
    node = NodeFactory(
        name="box", transport=Transport.LOCAL, address="127.0.0.1", last_seen_at=timezone.now()
    )
    state = gather_state()
    assert (state.has_local_node, state.has_trusted_node, state.has_probed_node) == (True, True, True)
    assert state.node_without_build == "box" and not state.has_build
    Build.objects.create(node=node, source_kind="existing", rpc_server_path=f"{BIN}/ggml-rpc-server",
                         llama_server_path=f"{BIN}/llama-server")  # fmt: skip
    state = gather_state()
    assert state.has_build and not state.has_calibrated_node and state.node_without_calibration == "box"
    step = next(s for s in checklist(state) if s.key == "calibrated")
    assert not step.done and step.url == reverse("nodes:detail", args=["box"])
    Node.objects.filter(pk=node.pk).update(calibrated_at=timezone.now())
    state = gather_state()
    assert state.has_calibrated_node and state.node_without_calibration == ""
    assert done(state)["calibrated"]
    # A deployment whose measure step got tokens has not "answered" yet: the chat box's first answer ticks it.
    model = ModelFile.objects.create(name="tiny", node=node, path="/m/tiny.gguf")
    deployment = Deployment.objects.create(
        name="tiny",
        model_file=model,
        coordinator=node,
        plan={},
        port=8080,
        measured_decode_tps=30.0,
        running_at=timezone.now(),
    )
    state = gather_state()
    assert state.has_run_deployment and not state.has_answering_deployment
    deployment.chat_answered_at = timezone.now()
    deployment.save(update_fields=["chat_answered_at"])
    assert gather_state().has_answering_deployment


def test_the_dashboard_shows_the_checklist_until_everything_is_done(admin_client):
    page = admin_client.get(reverse("dashboard")).content.decode()
    assert 'id="first-run"' in page and "0 of 10 done" in page
    assert 'id="first-run-credential-action"' in page  # the Add this machine button


def test_a_viewer_sees_the_checklist_without_the_admin_button(viewer_client):
    page = viewer_client.get(reverse("dashboard")).content.decode()
    assert 'id="first-run"' in page
    assert 'id="first-run-credential-action"' not in page and "An admin does this." in page


# "Add this machine" ----------------------------------------------------------------------------------


def test_add_this_machine_makes_a_local_coordinator_and_starts_a_probe_that_registers_llamacpp(admin_client):
    response = admin_client.post(reverse("nodes:add_this_machine"))
    node = Node.objects.get()
    assert response.status_code == 302 and response.url == node.get_absolute_url()
    assert node.transport == Transport.LOCAL and node.may_coordinate and node.address == "127.0.0.1"
    probe = Job.objects.get(node=node, kind="probe")
    assert probe.params == {"register_detected": True}
    assert list(AuditEvent.objects.values_list("action", flat=True).order_by("pk")) == [
        "node.create",
        "node.probe",
    ]


def test_the_same_machine_is_not_added_twice(admin_client):
    NodeFactory(name="console", transport=Transport.LOCAL, address="127.0.0.1")
    response = admin_client.post(reverse("nodes:add_this_machine"), follow=True)
    assert Node.objects.count() == 1
    assert "already node console" in response.content.decode()


def test_the_node_form_refuses_a_second_local_node_and_a_second_ssh_node_at_the_same_address(admin_client):
    NodeFactory(name="console", transport=Transport.LOCAL, address="127.0.0.1")
    form = {"name": "again", "address": "127.0.0.1", "transport": "local", "ssh_port": 22, "rpc_port": 50052,
            "platform_hint": "auto", "enabled": "on"}  # fmt: skip
    page = admin_client.post(reverse("nodes:create"), form).content.decode()
    assert "already node console" in page and "count its" in page
    credential = CredentialFactory()
    NodeFactory(name="attic", address="192.0.2.7", ssh_port=22)
    form |= {"transport": "ssh", "address": "192.0.2.7", "ssh_user": "ramdeck", "credential": credential.pk}
    page = admin_client.post(reverse("nodes:create"), form).content.decode()
    assert "Node attic already reaches 192.0.2.7 on SSH port 22" in page
    assert Node.objects.count() == 2


def test_an_operator_cannot_add_this_machine(operator_client):
    assert operator_client.post(reverse("nodes:add_this_machine")).status_code == 403
    assert not Node.objects.exists()


def test_the_detected_install_is_offered_on_the_builds_page_until_it_is_recorded(operator_client):
    from nodes.probe.job import start_detected_install_build

    facts = {"rpc_server_binary": f"{BIN}/ggml-rpc-server", "llama_server_binary": f"{BIN}/llama-server"}
    node = NodeFactory(name="box", facts=facts)
    page = operator_client.get(reverse("builds:node", args=["box"])).content.decode()
    assert 'id="use-detected-install"' in page and BIN in page
    job = start_detected_install_build(node)
    assert job.params == {"source": "existing", "path": BIN, "backend": "auto", "rebuild": False}
    assert start_detected_install_build(node) is None  # one build job at a time
    job.finish(JobState.SUCCEEDED)
    Build.objects.create(node=node, source_kind="existing", rpc_server_path=f"{BIN}/ggml-rpc-server",
                         llama_server_path=f"{BIN}/llama-server")  # fmt: skip
    assert start_detected_install_build(node) is None
    page = operator_client.get(reverse("builds:node", args=["box"])).content.decode()
    assert 'id="use-detected-install"' not in page


def test_binaries_in_different_folders_are_not_one_install():
    node = Node(facts={"rpc_server_binary": "/a/ggml-rpc-server", "llama_server_binary": "/b/llama-server"})
    assert node.detected_install_dir == ""


# SSH onboarding ----------------------------------------------------------------------------------------


def test_the_credential_form_generates_a_key_pair_and_shows_the_public_key_with_the_lines_to_run(
    admin_client,
):
    response = admin_client.post(
        reverse("nodes:credential_create"), {"name": "household key", "kind": "private_key", "generate": "on"}
    )
    credential = Credential.objects.get()
    assert response.status_code == 302
    assert response.url == reverse("nodes:credential_edit", args=[credential.pk])
    private = asyncssh.import_private_key(credential.secret())
    assert private.algorithm == b"ssh-ed25519"
    assert credential.public_key == private.export_public_key().decode().strip()
    assert "BEGIN OPENSSH PRIVATE KEY" not in credential.secret_encrypted  # stored encrypted
    page = admin_client.get(response.url).content.decode()
    assert credential.public_key.split()[1] in page
    assert "ssh-copy-id -f -i ramdeck-household-key.pub USER@NODE" in page
    assert "~/.ssh/authorized_keys" in page and "PRIVATE KEY" not in page
    event = AuditEvent.objects.get(action="credential.create")
    assert event.changes["key_pair"].startswith("generated (ed25519, SHA256:")


def test_generating_a_key_pair_and_pasting_one_at_once_is_refused(admin_client):
    response = admin_client.post(
        reverse("nodes:credential_create"),
        {
            "name": "k",
            "kind": "private_key",
            "generate": "on",
            "secret": "-----BEGIN OPENSSH PRIVATE KEY-----",
        },
    )
    assert response.status_code == 200 and "not both" in response.content.decode()
    assert not Credential.objects.exists()


def test_a_pasted_key_keeps_its_public_half_too(admin_client):
    key = asyncssh.generate_private_key("ssh-ed25519")
    admin_client.post(
        reverse("nodes:credential_create"),
        {"name": "k", "kind": "private_key", "secret": key.export_private_key().decode()},
    )
    assert Credential.objects.get().public_key == key.export_public_key().decode().strip()


# Host keys -----------------------------------------------------------------------------------------------


def test_a_job_that_met_an_unapproved_host_key_shows_it_with_the_approve_button(admin_client):
    node = NodeFactory(
        name="attic", pending_host_key="ssh-ed25519 AAAAC3Nz", pending_host_key_fingerprint="SHA256:abc"
    )
    job = Job.objects.create(kind="probe", node=node, state=JobState.RUNNING)
    job.finish(JobState.NEEDS_APPROVAL, result="The node offered a host key no admin has approved yet.")
    page = admin_client.get(job.get_absolute_url()).content.decode()
    assert "Needs approval" in page and "Errored" not in page
    assert reverse("nodes:approve_host_key", args=["attic"]) in page and "SHA256:abc" in page


async def refused_key_body(ctx) -> str:
    from remote.base import HostKeyUnknown

    raise HostKeyUnknown(
        "attic offered a host key no admin has approved yet.", offered_key="k", fingerprint="f"
    )


def test_the_runner_ends_a_job_refused_for_its_host_key_as_needing_approval(
    local_node, channel_layer, job_kind
):
    from jobs import runner

    job_kind("test-refused-key", refused_key_body)
    job = Job.objects.create(kind="test-refused-key", node=local_node)
    runner.run_job(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.NEEDS_APPROVAL and job.is_terminal
    assert "no admin has approved" in job.result


def test_the_checklist_is_gone_once_every_step_is_done(admin_client, monkeypatch):
    from console import first_run

    everything = FirstRunState(
        has_credential=True, has_local_node=True, has_node=True, has_trusted_node=True, has_probed_node=True,
        has_build=True, has_calibrated_node=True, has_model=True, has_deployment=True,
        has_run_deployment=True, has_answering_deployment=True, first_node="box", first_model=1,
        first_deployment=1,
    )  # fmt: skip
    assert all(step.done for step in checklist(everything))
    monkeypatch.setattr(first_run, "gather_state", lambda: everything)
    assert 'id="first-run"' not in admin_client.get(reverse("dashboard")).content.decode()
