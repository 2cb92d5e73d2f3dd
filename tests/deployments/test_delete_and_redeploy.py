"""Deleting a deployment (confirmed, stopped or failed ones; operators; it asks first; audited; refused with
the reason while it runs) and Redeploy as a new run of the same deployment, not a second one of that name."""

from __future__ import annotations

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from deployments.models import Deployment, DeploymentState, ResourceClaim, SpeedSample
from jobs.models import Job, JobState

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    "state", [DeploymentState.CONFIRMED, DeploymentState.STOPPED, DeploymentState.FAILED]
)
def test_an_operator_deletes_a_deployment_that_runs_nothing_after_confirming(
    operator_client, deployment, state
):
    Deployment.objects.filter(pk=deployment.pk).update(state=state)
    SpeedSample.objects.create(deployment=deployment, tokens_per_s=3.0)
    url = reverse("deployments:delete", args=[deployment.pk])
    run_page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert f'id="delete-button" href="{url}"' in run_page  # a link to the question, not a POST
    question = operator_client.get(url)
    assert question.status_code == 200
    page = question.content.decode()
    assert f"Delete {deployment.name}?" in page and 'name="confirm" value="yes"' in page
    assert Deployment.objects.filter(pk=deployment.pk).exists()  # asking deletes nothing
    # A POST without the confirmation deletes nothing either.
    assert operator_client.post(url).status_code == 400
    assert Deployment.objects.filter(pk=deployment.pk).exists()

    response = operator_client.post(url, {"confirm": "yes"}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("deployments:list")
    assert f"Deleted {deployment.name}." in response.content.decode()
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
    assert not SpeedSample.objects.exists()
    event = AuditEvent.objects.get(action="deployment.delete")
    assert event.actor_name == "oscar-operator" and event.object_id == str(deployment.pk)
    assert event.changes["state"] == state and event.changes["model"] == "tiny"


@pytest.mark.parametrize(
    "state",
    [DeploymentState.PREPARING, DeploymentState.RUNNING, DeploymentState.DEGRADED, DeploymentState.STOPPING],
)
def test_a_deployment_that_runs_is_not_deleted_and_the_page_says_why(operator_client, deployment, state):
    Deployment.objects.filter(pk=deployment.pk).update(state=state)
    url = reverse("deployments:delete", args=[deployment.pk])
    run_page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert 'id="delete-button"' not in run_page
    page = operator_client.get(url).content.decode()
    label = DeploymentState(state).label.lower()
    assert f"tiny is {label}: stop it first" in page and 'id="confirm-delete"' not in page
    response = operator_client.post(url, {"confirm": "yes"}, follow=True)
    assert response.redirect_chain[-1][0] == reverse("deployments:run", args=[deployment.pk])
    assert f"tiny is {label}: stop it first" in response.content.decode()
    assert Deployment.objects.filter(pk=deployment.pk).exists()
    refused = AuditEvent.objects.get(action="deployment.delete_refused")
    assert "stop it first" in refused.changes["reason"]
    assert not AuditEvent.objects.filter(action="deployment.delete").exists()


def test_a_stopped_deployment_whose_stop_run_is_still_finishing_is_not_deleted(operator_client, deployment):
    Deployment.objects.filter(pk=deployment.pk).update(state=DeploymentState.STOPPED)
    Job.objects.create(
        kind="undeploy",
        node=deployment.coordinator,
        params={"deployment": deployment.pk},
        state=JobState.RUNNING,
    )
    url = reverse("deployments:delete", args=[deployment.pk])
    response = operator_client.post(url, {"confirm": "yes"}, follow=True)
    assert "is still finishing" in response.content.decode()
    assert Deployment.objects.filter(pk=deployment.pk).exists()


def test_viewers_may_not_delete(viewer_client, deployment):
    url = reverse("deployments:delete", args=[deployment.pk])
    assert viewer_client.get(url).status_code == 403
    assert viewer_client.post(url, {"confirm": "yes"}).status_code == 403
    assert Deployment.objects.filter(pk=deployment.pk).exists()
    page = viewer_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert 'id="delete-button"' not in page


def test_redeploy_is_a_new_run_of_the_same_deployment_with_the_last_runs_findings_cleared(
    operator_client, deployment, no_enqueue, django_capture_on_commit_callbacks
):
    from deployments.lifecycle import actions as lifecycle

    with django_capture_on_commit_callbacks(execute=True):
        assert lifecycle.start_deploy(deployment, deployment.created_by)[0]
    first_run = Job.objects.get(kind="deploy")
    first_steps = set(deployment.steps.values_list("job_id", flat=True))
    # The first run failed at verify and was rolled back.
    Job.objects.filter(pk=first_run.pk).update(state=JobState.FAILED)
    deployment.refresh_from_db()
    assert deployment.fail("verify", "the placement differs")
    Deployment.objects.filter(pk=deployment.pk).update(
        verification={"problems": ["differs"]},
        measured_decode_tps=4.0,
        processes={"llama-server@desk": {"node": "desk", "role": "llama-server", "pid": 99}},
    )
    assert not ResourceClaim.objects.exists()

    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(reverse("deployments:redeploy", args=[deployment.pk]))
    assert response.url == reverse("deployments:run", args=[deployment.pk])
    assert Deployment.objects.count() == 1  # no second "tiny"
    deployment.refresh_from_db()
    assert deployment.state == DeploymentState.PREPARING
    assert (deployment.failed_step, deployment.state_reason, deployment.verification) == ("", "", {})
    assert deployment.measured_decode_tps is None and deployment.processes == {}
    assert deployment.claims.exists()
    second_run = Job.objects.filter(kind="deploy").exclude(pk=first_run.pk).get()
    assert second_run.title == f"Redeploy {deployment}"
    assert no_enqueue == [("deploy", deployment.pk), ("deploy", deployment.pk)]
    event = AuditEvent.objects.get(action="deployment.redeploy")
    assert event.object_id == str(deployment.pk) and event.changes["run"] == second_run.pk

    # The run page shows the new run's steps, and lists the earlier run apart.
    page = operator_client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    steps = page.split('id="steps"')[1].split("</section>")[0]
    for job in Job.objects.filter(pk__in=first_steps):
        assert job.get_absolute_url() not in steps
    for job in second_run.children.all():
        assert job.get_absolute_url() in steps
    earlier = page.split('id="earlier-runs"')[1].split("</section>")[0]
    assert first_run.get_absolute_url() in earlier and second_run.get_absolute_url() not in earlier

    # Pressed again while it deploys: refused, nothing more starts.
    response = operator_client.post(reverse("deployments:redeploy", args=[deployment.pk]), follow=True)
    assert "Only a stopped or failed deployment can be redeployed." in response.content.decode()
    assert Job.objects.filter(kind="deploy").count() == 2
