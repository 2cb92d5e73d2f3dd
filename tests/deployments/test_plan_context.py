"""The plan's context: it opens at the number the models list shows (one function decides both), it is capped
by the context the model was trained for unless an admin insists, and no suggestion goes past it."""

from __future__ import annotations

import re

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from deployments.models import Deployment
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.fit import default_context, pool_fit
from modelfiles.models import ModelFile
from nodes.models import DeviceKind, Transport
from nodes.pool import pool_nodes
from tests.factories import DeviceFactory, NodeFactory, UserFactory

MIB = 2**20
GIB = 2**30


@pytest.fixture
def roomy(db):
    """The console's host alone, with memory to spare for a tiny model at any context it was trained for."""
    desk = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True,
                       last_seen_at=timezone.now())  # fmt: skip
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=4 * GIB, free_bytes=4 * GIB,
                  bandwidth_gbs=20)  # fmt: skip
    return desk


@pytest.fixture
def smol(roomy, tmp_path, settings, admin_client):
    """A model trained for 8,192 tokens (as SmolLM2-135M is), registered through the page."""
    settings.RAMDECK_MODEL_DIRS = [str(tmp_path)]
    path = write_tiny_llama(tmp_path / "smol-8k.gguf", TinyLlama(n_ctx_train=8192))
    response = admin_client.post(reverse("modelfiles:register"), {"node": roomy.pk, "path": str(path)})
    assert response.status_code == 302, response.content.decode()[-2000:]
    return ModelFile.objects.get()


def client_as(role: str) -> Client:
    client = Client()
    client.force_login(UserFactory(username=f"someone-{role}", role=role))
    return client


def context_cell(page: str, model: ModelFile) -> str:
    row = page.split(f'id="model-{model.pk}"')[1].split("</tr>")[0]
    cells = re.findall(r'<td class="num">(.*?)</td>', row)
    return cells[2]  # size, blocks, context, tok/s


def plan_form_ctx(page: str) -> str:
    return re.search(r'<input type="number" name="ctx" value="(\d+)"', page).group(1)


def plan_url(model: ModelFile) -> str:
    return reverse("deployments:plan", args=[model.pk])


def test_the_plan_opens_at_the_context_the_models_list_shows(smol, admin_client):
    listed = context_cell(admin_client.get(reverse("modelfiles:list")).content.decode(), smol)
    response = admin_client.get(plan_url(smol))
    page = response.content.decode()
    assert listed == plan_form_ctx(page) == "8192"  # it opened at 4096 before
    assert response.context["plan"]["settings"]["ctx"] == 8192
    assert default_context(smol, pool_nodes()) == pool_fit(smol, pool_nodes())["ctx"] == 8192
    # The field says what the number means and what the model was trained for.
    help_text = page.split('id="field-ctx"')[1].split("</div></div>")[0]
    said = "How much of the conversation it remembers, in tokens; this model was trained for 8,192."
    assert said in help_text


def test_on_a_small_pool_both_say_the_longest_context_that_fits(model, viewer_client):
    listed = context_cell(viewer_client.get(reverse("modelfiles:list")).content.decode(), model)
    page = viewer_client.get(plan_url(model)).content.decode()
    assert int(listed) < 4096  # the tiny model was trained for 4096; this pool holds less
    assert plan_form_ctx(page) == listed
    assert 'id="predicted-tps"' in page and "does not fit" not in page


def test_a_context_past_the_trained_one_is_a_field_error_naming_it(smol):
    operator = client_as("operator")
    page = operator.get(plan_url(smol), {"ctx": 16384}).content.decode()
    errors = page.split('id="errors-ctx"')[1].split("</ul>")[0]
    assert "This model was trained for 8,192 tokens: give at most 8192" in errors
    assert "only an admin may go beyond it" in errors
    assert 'id="confirm-form"' not in page and 'id="server-command"' not in page
    assert 'name="beyond"' not in page  # operators are not offered the way past it
    # Posting it anyway (with the admins' box) confirms nothing.
    response = operator.post(reverse("deployments:confirm", args=[smol.pk]), {"ctx": 16384, "beyond": "on"})
    assert response.status_code == 409 and not Deployment.objects.exists()
    assert "This model was trained for 8,192 tokens" in response.content.decode()


def test_an_admin_who_ticks_go_beyond_plans_and_confirms_past_the_trained_context(smol):
    admin = client_as("admin")
    page = admin.get(plan_url(smol), {"ctx": 16384}).content.decode()
    assert 'name="beyond"' in page and "I know, go beyond the trained context" in page
    assert "tick “I know, go beyond” below" in page.split('id="errors-ctx"')[1].split("</ul>")[0]
    response = admin.get(plan_url(smol), {"ctx": 16384, "beyond": "on"})
    page = response.content.decode()
    assert response.context["plan"]["fits"] and "-c 16384" in page
    assert "The context (16384) is longer than the model was trained for (8192)." in page
    confirm_form = page.split('<form id="confirm-form"')[1].split("</form>")[0]
    assert '<input type="hidden" name="beyond" value="on">' in confirm_form
    data = dict(re.findall(r'name="([^"]+)" value="([^"]*)"', confirm_form))
    response = admin.post(reverse("deployments:confirm", args=[smol.pk]), data)
    assert response.status_code == 302
    assert Deployment.objects.get().plan_settings["ctx"] == 16384


def test_suggestions_never_exceed_the_trained_context(model, pool):
    """At a million tokens the tiny model (trained for 4,096) does not fit; the context suggested is the
    longest that fits up to 4,096, not the longest that fits up to a million."""
    admin = client_as("admin")
    response = admin.get(plan_url(model), {"ctx": 1_048_576, "beyond": "on", "full": 1,
                                           "nodes": [pool["desk"].pk, pool["pc"].pk]})  # fmt: skip
    plan = response.context["plan"]
    assert not plan["fits"]
    contexts = [s["value"] for s in plan["suggestions"] if s["change"] == "ctx"]
    assert contexts and all(0 < ctx <= 4096 for ctx in contexts)
    assert f"A context of {contexts[0]} tokens fits." in response.content.decode()
