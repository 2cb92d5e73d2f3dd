"""What does not apply is not shown: a plan on one machine says there is nothing to split (no duplicate
comparison with llama.cpp's default), a one-machine deployment has no RPC-mode selector, and llama-server's
/metrics numbers are sentences and a small chart, not Prometheus names."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from deployments.models import Deployment, DeploymentState, SpeedSample
from deployments.monitor import metrics_sentences
from tests.factories import UserFactory


def admin() -> Client:
    client = Client()
    user = User.objects.filter(username="ada-admin").first() or UserFactory(
        username="ada-admin", role="admin"
    )
    client.force_login(user)
    return client


def test_a_one_machine_plan_says_nothing_to_split_instead_of_a_duplicate_comparison(model, pool):
    url = reverse("deployments:plan", args=[model.pk])
    alone = {"full": 1, "ctx": 512, "parallel": 1, "cache_type": "f16", "nodes": [pool["desk"].pk]}
    page = admin().get(url, alone).content.decode()
    assert 'id="nothing-to-split"' in page and "one machine: nothing to split" in page
    assert 'id="baseline-tps"' not in page and 'id="pool-bar-default"' not in page
    region = page.split('id="plan"')[1]
    assert region.count('class="bar-row"') == 2  # this plan's bar for the device and for the pool, no twins
    # Two machines: the comparison is back.
    both = admin().get(url, {**alone, "nodes": [pool["desk"].pk, pool["pc"].pk]}).content.decode()
    assert 'id="nothing-to-split"' not in both and 'id="baseline-tps"' in both


def test_a_one_machine_deployment_has_no_rpc_mode_selector(model, pool):
    client = admin()
    data = {"full": 1, "ctx": 512, "parallel": 1, "cache_type": "f16", "clamp": 0.7,
            "nodes": [pool["desk"].pk], "name": "alone"}  # fmt: skip
    assert client.post(reverse("deployments:confirm", args=[model.pk]), data).status_code == 302
    alone = Deployment.objects.get(name="alone")
    assert not alone.plan["rpc_servers"]
    page = client.get(reverse("deployments:run", args=[alone.pk])).content.decode()
    assert 'id="rpc-mode-select"' not in page and "none: one machine, nothing to split" in page
    assert "llama.cpp&#x27;s default split (predicted)" not in page
    detail = client.get(reverse("deployments:detail", args=[alone.pk])).content.decode()
    assert "(one machine: nothing to split)" in detail
    # A deployment with a worker keeps the choice of how to reach its rpc-server.
    data = {**data, "nodes": [pool["desk"].pk, pool["pc"].pk], "name": "split"}
    assert client.post(reverse("deployments:confirm", args=[model.pk]), data).status_code == 302
    split = Deployment.objects.get(name="split")
    assert split.plan["rpc_servers"]
    page = client.get(reverse("deployments:run", args=[split.pk])).content.decode()
    assert 'id="rpc-mode-select"' in page and "nothing to split" not in page


@pytest.mark.parametrize(
    ("metrics", "said"),
    [
        (
            {"prompt_tokens_total": "52", "tokens_predicted_total": "1234",
             "tokens_predicted_seconds_total": "20", "requests_processing": "0", "requests_deferred": "0"},
            ["Since it started it has written 1,234 tokens in answer to 52 tokens of questions and "
             "conversation, at 61.7 tokens per second on average while writing.",
             "Nobody is waiting for an answer right now."],
        ),
        (
            {"tokens_predicted_total": "1", "requests_processing": "2", "requests_deferred": "1"},
            ["Since it started it has written 1 token.",
             "It is answering 2 requests right now; 1 more waits for a free slot."],
        ),
        ({"predicted_tokens_seconds": "12.34"}, ["It writes at 12.3 tokens per second on average."]),
        ({"tokens_predicted_total": "not a number"}, []),
        ({}, []),
    ],
)  # fmt: skip
def test_metrics_are_sentences(metrics, said):
    assert metrics_sentences(metrics) == said


def test_the_processes_panel_shows_sentences_and_the_last_hours_speed_not_metric_names(deployment):
    now = timezone.now()
    metrics = {
        "tokens_predicted_total": "900",
        "tokens_predicted_seconds_total": "30",
        "requests_processing": "1",
    }
    status = {"checked_at": now.isoformat(), "processes": [], "metrics": metrics}
    deployment.record(state=DeploymentState.RUNNING, live_status=status)
    for minutes, tps in ((40, 25.0), (20, None), (10, 31.5), (5, 28.0)):
        SpeedSample.objects.create(
            deployment=deployment, at=now - timedelta(minutes=minutes), tokens_per_s=tps
        )
    page = admin().get(reverse("deployments:processes", args=[deployment.pk])).content.decode()
    assert "tokens_predicted" not in page and "/metrics" not in page
    assert (
        "Since it started it has written 900 tokens, at 30.0 tokens per second on average while writing."
        in page
    )
    assert "It is answering 1 request right now." in page
    assert '<svg class="sparkline"' in page
    assert "Last hour: 25.0–31.5 tokens per second while writing, 28.0 at the last look." in page
    # Stopped: nothing live is claimed.
    deployment.record(state=DeploymentState.STOPPED)
    page = admin().get(reverse("deployments:processes", args=[deployment.pk])).content.decode()
    assert 'id="live-speed"' not in page and "Since it started" not in page
