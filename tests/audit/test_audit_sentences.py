"""Audit entries read as sentences, with no Python reprs in them."""

from __future__ import annotations

import pytest
from django.urls import reverse

from audit import history
from audit.models import AuditEvent
from audit.sentences import sentence, value_text
from tests.factories import NodeFactory


def event(action: str, changes=None, **fields) -> AuditEvent:
    """An unsaved entry: the sentences are pure functions of its fields."""
    defaults = {"actor_name": "alice", "object_type": "node", "object_repr": "this-box"}
    return AuditEvent(action=action, changes=changes or {}, **{**defaults, **fields})


def test_a_node_edit_reads_as_a_sentence():
    assert (
        sentence(event("node.update", {"name": [None, "this-box"]}))
        == "alice changed node this-box: name from — to this-box"
    )


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "—"),
        ("", "—"),
        (True, "yes"),
        (False, "no"),
        (3, "3"),
        (2.5, "2.5"),
        (["desk", "attic"], "desk, attic"),
        ([], "—"),
        ({"ctx": 4096, "host": "127.0.0.1"}, "ctx 4096, host 127.0.0.1"),
        ("b'flock exited'", "flock exited"),
    ],
)
def test_values_are_words_not_reprs(value, text):
    assert value_text(value) == text


def test_known_and_unknown_actions_both_read_as_words():
    assert sentence(event("login", object_type="user", object_repr="alice")) == "alice logged in"
    assert (
        sentence(event("node.calibrate_all", {"nodes": ["desk", "attic"]}, object_repr=""))
        == "alice started calibrating every node: nodes: desk, attic"
    )
    assert sentence(event("node.host_key.approve", {"replaced": False})) == (
        "alice approved the SSH host key of node this-box: replaced: no"
    )
    unknown = sentence(event("deployment.something_new", object_type="deployment", actor_name=""))
    assert unknown == "the console: deployment something new (deployment this-box)"
    denied = event("permission_denied", {"path": "/nodes/new/", "method": "POST", "needed": "admin"})
    assert sentence(denied) == "alice was refused /nodes/new/ (it needs the admin role)"


@pytest.mark.django_db
def test_the_audit_page_and_the_dashboard_show_sentences_without_reprs(admin_client):
    node = NodeFactory(name="this-box")
    history.record(None, "node.update", node, changes={"name": [None, "this-box"], "enabled": [False, True]},
                   actor_name="alice")  # fmt: skip
    page = admin_client.get(reverse("audit")).content.decode()
    assert "alice changed node this-box" in page and "enabled from no to yes; name from — to this-box" in page
    for repr_ in ("None", "[", "True", "False"):
        assert repr_ not in page.split('id="audit-table"')[1].split("</table>")[0]
    dashboard = admin_client.get(reverse("dashboard")).content.decode()
    assert "alice changed node this-box" in dashboard


def test_a_speed_is_not_mistaken_for_a_token_but_a_token_still_is():
    from audit.history import redact

    assert redact({"predicted_tokens_per_s": 12.5, "confirm_token": "abc", "token": "x"}) == {
        "predicted_tokens_per_s": 12.5,
        "confirm_token": "•••",
        "token": "•••",
    }


def test_what_the_console_did_on_its_own_is_said_in_its_name_not_a_persons():
    ran = event("deployment.running", {"decode_tps": 41.5}, object_type="deployment", actor_name="console")
    assert sentence(ran) == "the console saw deployment this-box running: decode tps: 41.5"
    down = event("deployment.degraded", {"reason": "llama-server on desk (PID 7) is not running."},
                 object_type="deployment", actor_name="monitor")  # fmt: skip
    assert sentence(down).startswith("the console's monitor saw deployment this-box stop working: reason: ")
    healing = event(
        "deployment.heal_started", {"attempt": 1}, object_type="deployment", actor_name="self-heal"
    )
    assert (
        sentence(healing)
        == "the console's self-healing started an attempt to heal deployment this-box: attempt: 1"
    )
    assert (
        sentence(event("node.offline", actor_name="console")) == "the console lost contact with node this-box"
    )
    assert sentence(event("node.online", actor_name="console")) == "the console reached node this-box again"
    # A person who happens to be called "console" is that person.
    assert sentence(event("node.update", actor_name="console", actor_id=7)).startswith("console changed node")
