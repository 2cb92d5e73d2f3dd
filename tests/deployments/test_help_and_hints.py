"""Plain words for a household: every field of the plan, endpoint, node, model and build forms has a one-line
hint, shown escaped beside it; the plan and run pages explain blocks, the compute buffer, --fit and the RPC
mode in a line each; and a help page, linked from every page's top bar, explains the words."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse

from builds.forms import BuildForm
from deployments.endpoint import EndpointForm
from deployments.forms import PlanForm
from modelfiles.forms import ModelDownloadForm, ModelRegisterForm
from nodes.forms import NodeForm
from nodes.models import Transport
from tests.factories import NodeFactory
from tests.paths import ROOT

WORDS = ("context", "tokens", "tokens-per-second", "kv-cache", "parallel-slots", "layers", "compute-buffer",
         "quantisation", "split", "node", "coordinator", "rpc-worker", "rpc-mode", "fit", "calibration",
         "endpoint")  # fmt: skip


def forms_with_fields(node):
    return {
        "plan": PlanForm(trained_ctx=8192, may_go_beyond=True),
        "endpoint": EndpointForm(coordinator=node),
        "node": NodeForm(),
        "model register": ModelRegisterForm(),
        "model download": ModelDownloadForm(),
        "build": BuildForm(),
    }


@pytest.mark.django_db
def test_every_field_of_the_plan_endpoint_node_model_and_build_forms_has_a_one_line_hint():
    node = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True)
    missing = []
    for form_name, form in forms_with_fields(node).items():
        for name, field in form.fields.items():
            hint = str(field.help_text or "")
            if not hint.strip() or "\n" in hint or len(hint) > 240:
                missing.append(f"{form_name}.{name}: {hint!r}")
    assert not missing, f"Fields without a one-line hint: {missing}"


def test_no_template_marks_a_hint_or_anything_else_safe():
    """Issue 17's rule: `|safe` only on what code built with format_html; hints are plain text."""
    offenders = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "templates").rglob("*.html")
        if re.search(r"help_text\s*\|\s*safe|\|\s*safe\b", path.read_text())
    ]
    assert not offenders


def test_the_plan_page_explains_its_words_in_a_line_each(model, viewer_client):
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 1024}).content.decode()
    hints = {
        "field-ctx": "How much of the conversation it remembers, in tokens; this model was trained for 4,096",
        "field-parallel": "How many conversations it answers at once",
        "field-cache_type": "f16 exact, q8_0 half the memory, q4_0 a quarter",
        "blocks-hint": "the output layer that picks the next token",
        "memory-hint": "the compute buffer scratch space for the work on each token",
        "fit-hint": "keeps llama.cpp to this plan's split",
    }
    for element_id, text in hints.items():
        assert text in page.split(f'id="{element_id}"')[1].split("</div>")[0], element_id


def test_a_hint_with_markup_in_it_is_shown_as_text(model, viewer_client, monkeypatch):
    payload = '<i hx-post="/users/new/" hx-trigger="load">KV</i>'
    monkeypatch.setattr(PlanForm.base_fields["cache_type"], "help_text", payload)
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 1024}).content.decode()
    assert payload not in page
    assert "&lt;i hx-post=&quot;/users/new/&quot; hx-trigger=&quot;load&quot;&gt;KV&lt;/i&gt;" in page


def test_the_help_page_explains_the_words_and_every_page_links_to_it(model, viewer_client):
    help_page = viewer_client.get(reverse("help"))
    assert help_page.status_code == 200
    text = help_page.content.decode()
    for word in WORDS:
        assert f'<section class="panel" id="{word}">' in text, word
    for url in (
        reverse("dashboard"),
        reverse("modelfiles:list"),
        reverse("deployments:plan", args=[model.pk]),
    ):
        page = viewer_client.get(url).content.decode()
        assert '<a href="/help/" id="help-link">Help</a>' in page, url
        # Each "more" link of a hint lands on a word the help page explains.
        for anchor in re.findall(r'href="/help/#([\w-]+)"', page):
            assert f'id="{anchor}"' in text, anchor


def test_the_help_page_needs_a_login(client):
    response = client.get(reverse("help"))
    assert response.status_code == 302 and "/login/" in response["Location"]
