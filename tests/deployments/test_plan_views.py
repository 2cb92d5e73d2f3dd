"""Model registry, pool overview, plan preview (htmx partial), confirmation with roles and audit."""

from __future__ import annotations

import re

import pytest
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEvent
from deployments.models import Deployment, DeploymentState
from llamacpp.gguf import profile_path
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.fit import pool_fit
from modelfiles.models import ModelFile
from nodes.models import Device, DeviceKind
from nodes.pool import pool_nodes
from planning import planner
from tests.factories import DeviceFactory, NodeFactory

MIB = 1024 * 1024


def test_an_admin_registers_a_local_model_by_path(model, gguf_path):
    assert model.path == str(gguf_path)
    assert model.profile["block_count"] == 8 and model.profile["architecture"] == "llama"
    assert model.shard_paths == [str(gguf_path)]
    assert model.size_bytes == gguf_path.stat().st_size
    event = AuditEvent.objects.get(action="model.register")
    assert event.actor_name == "alice-admin" and event.changes["path"] == str(gguf_path)


def test_a_file_that_is_not_gguf_is_refused_with_a_clear_error(pool, tmp_path, admin_client, settings):
    settings.RAMDECK_MODEL_DIRS = [str(tmp_path)]
    notes = tmp_path / "notes.gguf"
    notes.write_text("shopping list")
    response = admin_client.post(
        reverse("modelfiles:register"), {"name": "notes", "node": pool["desk"].pk, "path": str(notes)}
    )
    assert response.status_code == 400
    assert "not a GGUF file" in response.content.decode()
    assert not ModelFile.objects.exists()


def test_viewer_cannot_register_a_model(pool, gguf_path, viewer_client):
    response = viewer_client.post(
        reverse("modelfiles:register"), {"name": "x", "node": pool["desk"].pk, "path": str(gguf_path)}
    )
    assert response.status_code == 403
    assert not ModelFile.objects.exists()


def test_models_page_says_what_runs_on_this_pool(model, viewer_client):
    # Room for the model at a shorter context than it was trained on.
    Device.objects.filter(node__name="desk").update(total_bytes=16 * MIB, free_bytes=16 * MIB)
    page = viewer_client.get(reverse("modelfiles:list")).content.decode()
    assert "tiny" in page and "fits" in page
    fit = pool_fit(model, pool_nodes())
    # The longest context that fits, and the next longer one (within the trained 4096) does not.
    assert fit["fits"] and f">{fit['ctx']}<" in page and f"{fit['tps']:.1f}" in page
    assert fit["ctx"] < 4096
    assert "Register a model" not in page  # viewers see no form


def test_plan_preview_shows_each_device_with_bars_prediction_and_commands(model, viewer_client):
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 1024}).content.decode()
    assert 'data-device="desk/CPU"' in page and 'data-device="pc/CPU"' in page
    # One bar for this plan and one for llama.cpp's default per device, and the pool-wide pair, with labels.
    assert page.count('class="bar-row"') == 2 * 2 + 2
    assert 'id="pool-bar-plan"' in page and 'id="pool-bar-default"' in page
    assert 'data-part="weights"' in page and 'data-part="kv"' in page and 'data-part="free"' in page
    assert 'class="limit at' in page  # the plan's limit on the device
    assert "style=" not in page.split('id="plan"')[1]  # widths are classes: nothing for a CSP to refuse
    assert 'id="predicted-tps"' in page and 'id="baseline-tps"' in page
    assert "ggml-rpc-server -H 10.77.0.2 -p 50052 -d CPU" in page
    assert "llama-server -m " in page and "--rpc 10.77.0.2:50052" in page and "--fit off" in page
    assert 'id="confirm-plan"' not in page  # viewers cannot confirm


def test_htmx_recompute_returns_only_the_plan_and_follows_the_context(model, pool, viewer_client):
    url = reverse("deployments:plan", args=[model.pk])
    form = {
        "full": 1,
        "parallel": 1,
        "cache_type": "f16",
        "clamp": 0.7,
        "nodes": [pool["desk"].pk, pool["pc"].pk],
    }
    small = viewer_client.get(url, {**form, "ctx": 512}, HTTP_HX_REQUEST="true").content.decode()
    assert small.lstrip().startswith('<section id="plan"') and "<html" not in small
    big = viewer_client.get(url, {**form, "ctx": 2048}, HTTP_HX_REQUEST="true").content.decode()
    assert "-c 2048" in big and "-c 512" in small
    # Only the coordinator ticked: the worker leaves the plan.
    alone = viewer_client.get(url, {**form, "ctx": 512, "nodes": [pool["desk"].pk]}, HTTP_HX_REQUEST="true")
    assert "pc/CPU" not in alone.content.decode()


def test_a_plan_that_does_not_fit_shows_computed_suggestions(model, viewer_client):
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 4096, "parallel": 1,
                             "cache_type": "f16", "clamp": 0.7}).content.decode()  # fmt: skip
    assert "It does not fit" in page
    assert "A context of" in page


def test_operator_confirms_a_plan_into_a_confirmed_deployment(model, operator_client):
    data = {"ctx": 1024, "parallel": 1, "cache_type": "f16", "clamp": 0.7, "name": "tiny for the family"}
    response = operator_client.post(reverse("deployments:confirm", args=[model.pk]), data)
    deployment = Deployment.objects.get()
    assert response.status_code == 302 and response["Location"] == deployment.get_absolute_url()
    assert deployment.state == DeploymentState.CONFIRMED
    assert deployment.name == "tiny for the family" and deployment.coordinator.name == "desk"
    assert deployment.plan["fits"] and deployment.plan["settings"]["ctx"] == 1024
    event = AuditEvent.objects.get(action="deployment.confirm")
    assert event.object_id == str(deployment.pk) and event.changes["model"] == "tiny"
    detail = operator_client.get(deployment.get_absolute_url()).content.decode()
    assert "tiny for the family" in detail and "Confirmed" in detail
    assert "tiny for the family" in operator_client.get(reverse("deployments:list")).content.decode()


def test_viewer_cannot_confirm_a_plan(model, viewer_client):
    data = {"ctx": 1024, "parallel": 1, "cache_type": "f16", "clamp": 0.7}
    response = viewer_client.post(reverse("deployments:confirm", args=[model.pk]), data)
    assert response.status_code == 403
    assert not Deployment.objects.exists()


def test_a_plan_that_does_not_fit_cannot_be_confirmed(model, operator_client):
    data = {"ctx": 4096, "parallel": 1, "cache_type": "f16", "clamp": 0.7}
    response = operator_client.post(reverse("deployments:confirm", args=[model.pk]), data)
    assert response.status_code == 409
    assert not Deployment.objects.exists()


# -- Apple unified memory: one clamp, from the setting to the form to the plan -------------------------------


@pytest.fixture
def mac(pool):
    """A Mac in the pool, as its probe stores it: raw unified memory (64 MiB here, for the tiny model)."""
    node = NodeFactory(name="mac", address="10.77.0.3", rpc_port=50052, rtt_ms=0.3, may_coordinate=True,
                       last_seen_at=timezone.now())  # fmt: skip
    DeviceFactory(node=node, name="MTL0", kind=DeviceKind.METAL, total_bytes=64 * MIB, free_bytes=64 * MIB,
                  unified_memory=True, bandwidth_gbs=400)  # fmt: skip
    return node


def plan_page(client, model, **query):
    response = client.get(reverse("deployments:plan", args=[model.pk]), query)
    assert response.status_code == 200
    return response.context["plan"], response.content.decode()


def metal_of(plan: dict) -> dict:
    return next(p for p in plan["placements"] if p["device"] == "MTL0")


def test_the_clamp_setting_is_the_plan_forms_default_and_what_it_plans_with(
    model, mac, viewer_client, settings
):
    settings.RAMDECK_UNIFIED_MEMORY_CLAMP = 0.5
    plan, page = plan_page(viewer_client, model, ctx=1024)
    assert 'id="clamp-field"' in page and 'name="clamp" value="0.5"' in page
    assert plan["settings"]["clamp"] == 0.5
    metal = metal_of(plan)
    assert (metal["limit_bytes"], metal["limit_basis"]) == (32 * MIB, "clamp")
    assert "Planned with 50% of 64.0 MiB unified memory: 32.0 MiB." in page


def test_a_clamp_edited_on_the_form_changes_the_plan(model, mac, viewer_client):
    default, page = plan_page(viewer_client, model, ctx=1024)
    assert metal_of(default)["limit_bytes"] == int(0.70 * 64 * MIB)
    assert "Planned with 70% of 64.0 MiB unified memory: 44.8 MiB." in page
    edited, page = plan_page(viewer_client, model, ctx=1024, clamp=0.25)
    assert metal_of(edited)["limit_bytes"] == int(0.25 * 64 * MIB)
    assert 0 < metal_of(edited)["layers"] < metal_of(default)["layers"]
    assert edited["predicted_tokens_per_s"] < default["predicted_tokens_per_s"]
    assert "Planned with 25% of 64.0 MiB unified memory: 16.0 MiB." in page


def test_a_wired_limit_below_the_clamp_is_what_the_page_says_it_plans_with(model, mac, viewer_client):
    mac.devices.filter(name="MTL0").update(wired_limit_bytes=24 * MIB)
    plan, page = plan_page(viewer_client, model, ctx=1024)
    assert (metal_of(plan)["limit_bytes"], metal_of(plan)["limit_basis"]) == (24 * MIB, "wired_limit")
    assert "Planned with the Mac's wired limit, 24.0 MiB (iogpu.wired_limit_mb)" in page


def test_the_clamp_field_is_hidden_when_no_unified_memory_is_in_the_pool(model, viewer_client):
    plan, page = plan_page(viewer_client, model, ctx=1024)
    assert plan["fits"]
    assert 'id="clamp-field"' not in page
    assert '<input type="hidden" name="clamp" value="0.7">' in page  # still sent with every recompute


def test_a_mac_coordinates_from_the_plan_page_on_one_pool(model, mac, viewer_client):
    plan, page = plan_page(viewer_client, model, ctx=1024, coordinator=mac.pk)
    assert plan["fits"] and plan["coordinator"] == "mac"
    assert [(p["node"], p["llama_device"]) for p in plan["placements"][:2]] == [
        ("mac", "CPU"),
        ("mac", "MTL0"),
    ]
    pool = plan["unified_pool"]
    assert pool["limit_bytes"] == int(0.70 * 64 * MIB) and pool["used_bytes"] <= pool["capacity_bytes"]
    assert "mac's CPU and MTL0 share one unified memory" in page
    assert "(70% of 64.0 MiB)" in page
    assert "Draws on mac's unified memory, the pool it shares with MTL0." in page


def test_the_pool_overview_plans_with_the_clamp_setting(model, mac, settings):
    settings.RAMDECK_UNIFIED_MEMORY_CLAMP = 1.0
    roomy = pool_fit(model, pool_nodes())
    settings.RAMDECK_UNIFIED_MEMORY_CLAMP = 0.1
    tight = pool_fit(model, pool_nodes())
    assert roomy["fits"] and tight["fits"]
    assert (roomy["ctx"], roomy["tps"]) > (tight["ctx"], tight["tps"])


# -- Invalid input: the field says why, the plan says it is stale, nothing falls back to a default ----------


@pytest.mark.parametrize(
    ("ctx", "message"),
    [
        ("2000000", "less than or equal to 1048576"),
        ("-5", "greater than or equal to 256"),
        ("lots", "Enter a whole number"),
    ],
)
def test_an_invalid_context_marks_the_field_and_plans_nothing(model, operator_client, ctx, message):
    url = reverse("deployments:plan", args=[model.pk])
    page = operator_client.get(url, {"ctx": ctx, "parallel": 1, "cache_type": "f16"}).content.decode()
    errors = page.split('id="errors-ctx"')[1].split("</ul>")[0]
    assert message in errors and "Context:" in errors
    stale = page.split('id="plan-stale"')[1].split('id="confirm-row"')[0]
    assert "Not planned" in stale and message in stale
    # No plan for some other context than the one typed (the old fallback planned 4096 or 32768 silently).
    assert 'id="predicted-tps"' not in page and 'id="server-command"' not in page
    assert 'id="confirm-form"' not in page
    assert '<button class="button" id="confirm-plan" type="submit" form="confirm-form" disabled>' in page


def test_an_invalid_recompute_keeps_the_shown_plan_and_marks_it_stale(model, operator_client):
    url = reverse("deployments:plan", args=[model.pk])
    response = operator_client.get(url, {"full": 1, "ctx": 2_000_000, "parallel": 1, "cache_type": "f16"},
                                   HTTP_HX_REQUEST="true")  # fmt: skip
    assert response.status_code == 200
    assert response["HX-Reswap"] == "none"  # the plan on the page stays, under the stale mark
    html = response.content.decode()
    assert '<div id="plan-stale" hx-swap-oob="outerHTML">' in html and "Stale:" in html
    errors = '<ul class="errorlist" id="errors-ctx" hx-swap-oob="outerHTML"><li>Context: Ensure this value'
    assert errors in html
    assert 'id="confirm-plan" type="submit" form="confirm-form" disabled' in html
    # A valid recompute clears the marks again.
    fixed = operator_client.get(url, {"full": 1, "ctx": 1024, "parallel": 1, "cache_type": "f16",
                                      "nodes": [model.node.pk]}, HTTP_HX_REQUEST="true")  # fmt: skip
    html = fixed.content.decode()
    assert "HX-Reswap" not in fixed and "-c 1024" in html
    assert '<ul class="errorlist" id="errors-ctx" hx-swap-oob="outerHTML"></ul>' in html
    assert '<div id="plan-stale"></div>' in html
    assert 'id="confirm-plan" type="submit" form="confirm-form">' in html


def test_the_settings_form_carries_no_csrf_token_and_confirm_follows_the_evidence(model, operator_client):
    page = operator_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 1024}).content.decode()
    settings_form = page.split('<form id="plan-form"')[1].split("</form>")[0]
    assert 'method="get"' in settings_form and "csrfmiddlewaretoken" not in settings_form
    assert "novalidate" in settings_form  # the server validates; the browser does not swallow the request
    confirm_form = page.split('<form id="confirm-form"')[1].split("</form>")[0]
    assert 'method="post"' in confirm_form and "csrfmiddlewaretoken" in confirm_form
    assert '<input type="hidden" name="ctx" value="1024">' in confirm_form
    # The evidence (prediction, bars, commands) comes before the Confirm button.
    confirm_at = page.index('id="confirm-plan"')
    assert page.index('id="predicted-tps"') < page.index('id="server-command"') < confirm_at
    assert page.index('id="pool-bar-plan"') < page.index('id="confirm-plan"')


def test_confirm_posts_the_values_the_shown_plan_was_computed_with(model, operator_client):
    page = operator_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 1024}).content.decode()
    confirm_form = page.split('<form id="confirm-form"')[1].split("</form>")[0]
    data: dict[str, list[str]] = {}
    for name, value in re.findall(r'name="([^"]+)" value="([^"]*)"', confirm_form):
        data.setdefault(name, []).append(value)
    data["name"] = ["from the page"]
    response = operator_client.post(reverse("deployments:confirm", args=[model.pk]), data)
    assert response.status_code == 302
    deployment = Deployment.objects.get()
    assert deployment.name == "from the page" and deployment.plan_settings["ctx"] == 1024


def test_controls_with_one_choice_are_text_not_inputs(model, pool, viewer_client):
    url = reverse("deployments:plan", args=[model.pk])
    page = viewer_client.get(url, {"ctx": 1024}).content.decode()
    # One node may coordinate (desk): named, not a select; two nodes to choose from: the checkboxes stay.
    assert '<select name="coordinator"' not in page and '<div id="only-coordinator">desk</div>' in page
    assert f'<input type="hidden" name="coordinator" value="{pool["desk"].pk}">' in page
    assert 'type="checkbox" name="nodes"' in page
    pool["pc"].may_coordinate = True
    pool["pc"].save()
    page = viewer_client.get(url, {"ctx": 1024}).content.decode()
    assert '<select name="coordinator"' in page and 'id="only-coordinator"' not in page
    pool["pc"].enabled = False
    pool["pc"].save()
    page = viewer_client.get(url, {"ctx": 1024}).content.decode()
    assert 'type="checkbox" name="nodes"' not in page
    assert f'<input type="hidden" name="nodes" value="{pool["desk"].pk}">' in page
    assert 'id="server-command"' in page and "--rpc" not in page  # the plan is for desk alone


def test_the_default_name_says_the_context_llama_cpp_will_give_not_more(model):
    from deployments.views.plan import default_deployment_name

    trained = model.profile["context_length"]
    assert trained > 0
    assert default_deployment_name(model, {"settings": {"ctx": trained * 2}}) == f"tiny @ {trained}"
    assert default_deployment_name(model, {"settings": {"ctx": 512}}) == "tiny @ 512"


def test_the_plan_page_says_where_a_mixture_of_experts_puts_its_experts(db, tmp_path, viewer_client):
    """A generated Mixtral-style model on a desktop whose small GPU runs every block's attention: the
    experts that do not fit beside it stay in the desktop's RAM, and each device's line says whose."""
    desk = NodeFactory(name="desk", address="127.0.0.1", may_coordinate=True, last_seen_at=timezone.now())
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=64 * MIB, free_bytes=64 * MIB,
                  bandwidth_gbs=20)  # fmt: skip
    DeviceFactory(node=desk, name="CUDA0", kind=DeviceKind.CUDA, total_bytes=24 * MIB, free_bytes=24 * MIB,
                  bandwidth_gbs=300)  # fmt: skip
    path = write_tiny_llama(tmp_path / "moe.gguf", TinyLlama(n_layer=4, n_expert=8, n_expert_used=2))
    model = ModelFile.objects.create(name="moe", node=desk, path=str(path), profile=profile_path(path))
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 512}).content.decode()
    assert 'id="experts-note"' in page and "only 2 of its 8 experts" in page
    assert '<p class="muted experts" data-experts="desk/CPU">experts of blocks 0–1</p>' in page
    assert '<p class="muted experts" data-experts="desk/CUDA0">experts of blocks 2–3</p>' in page
    assert "-ot &#x27;blk\\.(0|1)\\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU&#x27;" in page


def test_until_its_nodes_are_calibrated_the_plans_speed_is_marked_a_guess_from_the_table(
    model, pool, viewer_client
):
    url = reverse("deployments:plan", args=[model.pk])
    page = viewer_client.get(url, {"ctx": 1024}).content.decode()
    guess = re.search(r'<div class="speed-guess" id="speed-guess">(.*?)</div>', page, flags=re.S)
    assert guess, "no guess note beside the prediction"
    assert "guess: not measured yet" in guess.group(1)
    assert "desk, pc are not calibrated yet: their speed figures come from a table" in guess.group(1)
    assert 'data-guess="desk/CPU"' in page and 'data-guess="pc/CPU"' in page
    # One calibrated node: only the other's figures are still guesses.
    pool["pc"].devices.get().record_measurement(bandwidth_gbs=40.0, overhead_ms=0.1)
    type(pool["pc"]).objects.filter(pk=pool["pc"].pk).update(calibrated_at=timezone.now())
    page = viewer_client.get(url, {"ctx": 1024}).content.decode()
    assert "desk is not calibrated yet: its speed figures come from a table" in page
    assert 'data-guess="desk/CPU"' in page and 'data-guess="pc/CPU"' not in page
    # Both calibrated: no guess is left on the page.
    type(pool["desk"]).objects.filter(pk=pool["desk"].pk).update(calibrated_at=timezone.now())
    page = viewer_client.get(url, {"ctx": 1024}).content.decode()
    assert "guess: not measured yet" not in page and 'id="speed-guess"' not in page


def test_the_plan_page_says_a_windows_worker_is_reached_directly_and_why(model, pool, viewer_client):
    pool["pc"].facts = {"platform": "windows"}  # what its probe found
    pool["pc"].save()
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 1024}).content.decode()
    warnings = page.split('<ul class="warnings">', 1)[1].split("</ul>", 1)[0]
    assert "RPC to pc goes directly over the LAN, never through an SSH tunnel: pc runs Windows" in warnings
    assert "administrators_authorized_keys" in warnings


def test_the_plan_page_shows_first_token_and_load_beside_decode_speed(model, viewer_client):
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 1024}).content.decode()
    row = page.split('id="plan-first-word"')[1].split("</div>")[0]
    # A prompt as long as one slot's context holds (2,000 tokens where it holds them), as measured.
    assert "first token after 1008 tokens" in row and " s cold" in row and " s warm" in row


def _calibrated(pool, desk_gflops: float, pc_gflops: float) -> None:
    for name, bandwidth, gflops in (("desk", 2, desk_gflops), ("pc", 50, pc_gflops)):
        node = pool[name]
        node.calibrated_at = timezone.now()
        node.save(update_fields=["calibrated_at"])
        node.devices.get().record_measurement(bandwidth_gbs=bandwidth, overhead_ms=0.1, prompt_gflops=gflops)


def test_a_split_better_for_long_prompts_is_offered_and_confirmed_when_chosen(model, pool, operator_client):
    # The worker decodes fast (its memory) but computes prompts slowly; the coordinator the other way round.
    _calibrated(pool, desk_gflops=2000, pc_gflops=0.5)
    url = reverse("deployments:plan", args=[model.pk])
    page = operator_client.get(url, {"ctx": 1024}).content.decode()
    assert 'id="prompt-option"' in page and "For long prompts another split is better" in page
    link = re.search(r'id="choose-prompt" href="([^"]+)"', page)[1].replace("&amp;", "&")
    assert "objective=prompt" in link
    chosen = operator_client.get(link).content.decode()
    assert 'id="prompt-objective"' in chosen and 'id="choose-decode"' in chosen
    assert '<input type="hidden" name="objective" value="prompt">' in chosen
    data = {"ctx": 1024, "parallel": 1, "cache_type": "f16", "clamp": 0.7, "objective": "prompt"}
    operator_client.post(reverse("deployments:confirm", args=[model.pk]), data)
    deployment = Deployment.objects.get()
    assert deployment.plan["objective"] == "prompt"
    assert (
        deployment.plan["decode_option"]["predicted_tokens_per_s"] > deployment.plan["predicted_tokens_per_s"]
    )


def test_no_prompt_option_when_the_decode_split_is_also_best_for_prompts(model, pool, viewer_client):
    _calibrated(pool, desk_gflops=1, pc_gflops=1000)
    page = viewer_client.get(reverse("deployments:plan", args=[model.pk]), {"ctx": 1024}).content.decode()
    assert 'id="prompt-option"' not in page and 'id="prompt-objective"' not in page


def test_a_split_chosen_for_its_first_word_says_so_and_the_fastest_decode_is_one_click_away(
    model, pool, operator_client, monkeypatch
):
    # Decode speeds this far apart count as alike here, so the split best for long prompts is the plan.
    monkeypatch.setattr(planner, "DECODE_TIE", 10.0)
    _calibrated(pool, desk_gflops=2000, pc_gflops=0.5)
    url = reverse("deployments:plan", args=[model.pk])
    page = operator_client.get(url, {"ctx": 1024}).content.decode()
    assert 'id="first-word-tie"' in page and "Chosen for its first word" in page, page
    assert 'id="prompt-option"' not in page
    link = re.search(r'id="choose-fastest" href="([^"]+)"', page)[1].replace("&amp;", "&")
    assert "objective=fastest" in link
    fastest = operator_client.get(link).content.decode()
    assert 'id="prompt-option"' in fastest  # the split for long prompts is offered again, as before
    assert '<input type="hidden" name="objective" value="fastest">' in fastest
    data = {"ctx": 1024, "parallel": 1, "cache_type": "f16", "clamp": 0.7, "objective": "fastest"}
    operator_client.post(reverse("deployments:confirm", args=[model.pk]), data)
    deployment = Deployment.objects.get()
    assert deployment.plan["objective"] == "fastest" and deployment.plan["prompt_option"] is not None
