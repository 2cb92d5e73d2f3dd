"""Node inventory pages: listing, filtering, create/edit validation, delete with confirmation, roles."""

from __future__ import annotations

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from nodes.models import Node
from tests.factories import CredentialFactory, NodeFactory

pytestmark = pytest.mark.django_db


def node_post(credential, **overrides):
    data = {
        "name": "desk",
        "address": "192.0.2.10",
        "transport": "ssh",
        "ssh_port": 22,
        "ssh_user": "ramdeck",
        "credential": credential.pk,
        "rpc_port": 50052,
        "rpc_bind_address": "",
        "rpc_tunnel": "on",
        "platform_hint": "auto",
        "notes": "",
        "enabled": "on",
    }
    data.update(overrides)
    return data


def test_anonymous_visitor_is_sent_to_login(client):
    response = client.get(reverse("nodes:list"))
    assert response.status_code == 302
    assert response.url.startswith(reverse("login"))


def test_admin_adds_a_node_and_the_audit_history_records_it(admin_client):
    credential = CredentialFactory()
    response = admin_client.post(reverse("nodes:create"), node_post(credential))
    node = Node.objects.get(name="desk")
    assert response.status_code == 302 and response.url == node.get_absolute_url()
    event = AuditEvent.objects.get(action="node.create")
    assert event.object_id == str(node.pk)
    assert event.actor_name == "alice-admin"
    assert event.changes["address"] == [None, "192.0.2.10"]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("address", "not a host!", "is not a valid hostname or IP address"),
        ("address", "300.1.2.3", "is not a valid hostname or IP address"),
        ("ssh_port", "0", "greater than or equal to 1"),
        ("ssh_port", "70000", "less than or equal to 65535"),
        ("rpc_port", "65536", "less than or equal to 65535"),
        ("name", "has spaces", "(no spaces), such as old-pc"),
        ("address", "", "An SSH node needs its address"),
        ("ssh_port", "", "An SSH node needs the port"),
        ("ssh_user", "", "needs the user to log in as"),
        ("rpc_bind_address", "0.0.0.0", "exposes the unauthenticated RPC server"),
        ("rpc_bind_address", "::", "listens on IPv4 only"),
        ("rpc_bind_address", "0", "exposes the unauthenticated RPC server"),
        ("rpc_bind_address", "00", "exposes the unauthenticated RPC server"),
        ("rpc_bind_address", "0x0", "exposes the unauthenticated RPC server"),
        ("rpc_bind_address", "fd00::5", "listens on IPv4 only"),
    ],
)
def test_bad_node_input_re_renders_the_form_naming_the_problem(admin_client, field, value, message):
    credential = CredentialFactory()
    response = admin_client.post(reverse("nodes:create"), node_post(credential, **{field: value}))
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not Node.objects.exists()
    assert not AuditEvent.objects.filter(action="node.create").exists()


def test_duplicate_node_name_is_refused(admin_client):
    credential = CredentialFactory()
    NodeFactory(name="desk")
    response = admin_client.post(reverse("nodes:create"), node_post(credential, address="192.0.2.11"))
    assert response.status_code == 200
    assert "Node with this Name already exists." in response.content.decode()
    assert Node.objects.count() == 1


def test_ipv6_and_hostnames_are_accepted(admin_client):
    credential = CredentialFactory()
    admin_client.post(reverse("nodes:create"), node_post(credential, name="v6", address="fd00::2"))
    admin_client.post(reverse("nodes:create"), node_post(credential, name="mac", address="mac-mini.local"))
    assert set(Node.objects.values_list("address", flat=True)) == {"fd00::2", "mac-mini.local"}


def test_local_node_needs_no_ssh_details(admin_client):
    response = admin_client.post(
        reverse("nodes:create"),
        {
            "name": "console",
            "address": "127.0.0.1",
            "transport": "local",
            "ssh_port": 22,
            "rpc_port": 50052,
            "platform_hint": "auto",
            "enabled": "on",
        },
    )
    assert response.status_code == 302
    assert Node.objects.get(name="console").is_local


def test_edit_records_only_what_changed(admin_client):
    credential = CredentialFactory()
    node = NodeFactory(name="desk", credential=credential, address="192.0.2.10", ssh_user="ramdeck")
    response = admin_client.post(
        reverse("nodes:edit", args=["desk"]), node_post(credential, address="192.0.2.20")
    )
    assert response.status_code == 302
    node.refresh_from_db()
    assert node.address == "192.0.2.20"
    event = AuditEvent.objects.get(action="node.update")
    assert event.changes == {"address": ["192.0.2.10", "192.0.2.20"]}


def test_htmx_filter_returns_only_the_table(admin_client):
    NodeFactory(name="desk", address="192.0.2.10")
    NodeFactory(name="attic", address="192.0.2.11")
    response = admin_client.get(
        reverse("nodes:list"), {"q": "att"}, HTTP_HX_REQUEST="true", HTTP_HX_TARGET="node-table"
    )
    body = response.content.decode()
    assert 'id="node-table"' in body
    assert "<html" not in body
    assert "attic" in body and "desk" not in body


def test_delete_needs_post_and_removes_the_node(admin_client):
    NodeFactory(name="desk")
    confirm_page = admin_client.get(reverse("nodes:delete", args=["desk"]))
    assert confirm_page.status_code == 200 and Node.objects.filter(name="desk").exists()
    response = admin_client.post(reverse("nodes:delete", args=["desk"]), HTTP_HX_REQUEST="true")
    assert response.status_code == 200 and response.content == b""
    assert not Node.objects.filter(name="desk").exists()
    assert AuditEvent.objects.filter(action="node.delete", object_repr="desk").exists()


def test_viewer_sees_nodes_but_no_add_button(viewer_client):
    NodeFactory(name="desk")
    body = viewer_client.get(reverse("nodes:list")).content.decode()
    assert "desk" in body
    assert 'id="add-node"' not in body


def test_viewer_posting_an_admin_form_gets_403_and_an_audit_entry(viewer_client):
    credential = CredentialFactory()
    response = viewer_client.post(reverse("nodes:create"), node_post(credential))
    assert response.status_code == 403
    assert not Node.objects.exists()
    event = AuditEvent.objects.get(action="permission_denied")
    assert event.actor_name == "vera-viewer"
    assert event.changes["path"] == reverse("nodes:create")


def test_operator_cannot_delete_nodes(operator_client):
    NodeFactory(name="desk")
    assert operator_client.post(reverse("nodes:delete", args=["desk"])).status_code == 403
    assert Node.objects.filter(name="desk").exists()


def test_user_without_a_role_sees_no_inventory(client, stranger_user):
    client.force_login(stranger_user)
    assert client.get(reverse("nodes:list")).status_code == 403


def test_only_a_ticked_box_lets_an_admin_bind_every_interface_stored_normalised(admin_client):
    credential = CredentialFactory()
    refused = admin_client.post(reverse("nodes:create"), node_post(credential, rpc_bind_address="0x0"))
    assert refused.status_code == 200 and "means every interface (0.0.0.0)" in refused.content.decode()
    allowed = admin_client.post(
        reverse("nodes:create"), node_post(credential, rpc_bind_address="0x0", rpc_bind_everywhere="on")
    )
    assert allowed.status_code == 302
    node = Node.objects.get(name="desk")
    assert node.rpc_bind_address == "0.0.0.0" and node.rpc_binds_everywhere
    assert AuditEvent.objects.get(action="node.create").changes["rpc_bind_address"][-1] == "0.0.0.0"
    node.rpc_bind_address = "10.1"
    assert not node.rpc_binds_everywhere
