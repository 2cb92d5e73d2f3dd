"""Job pages: list and filters, the log tail and its partials, download, cancel, run a command."""

from __future__ import annotations

import dataclasses

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from jobs.models import Job, JobState
from tests.factories import NodeFactory, UserFactory
from tests.job_fixtures import make_command_job

pytestmark = pytest.mark.django_db


@pytest.fixture
def node(db):
    return NodeFactory(name="attic", address="127.0.0.1", transport="local")


@pytest.fixture
def ssh_node(db):
    return NodeFactory(name="cellar", address="10.77.0.2", transport="ssh")


def add_lines(job: Job, count: int, *, stream: str = "out", text: str = "line {i}") -> None:
    for start in range(0, count, 5000):
        job.append_lines([(stream, text.format(i=i)) for i in range(start, min(count, start + 5000))])


def test_viewer_sees_the_job_list_with_state_badges(viewer_client, node):
    job = make_command_job(node, ["uname", "-a"])
    Job.objects.filter(pk=job.pk).update(state=JobState.FAILED)
    response = viewer_client.get(reverse("jobs:list"))
    assert response.status_code == 200
    html = response.content.decode()
    assert f'id="job-badge-{job.pk}" class="badge failed"' in html
    assert 'ws-connect="/ws/jobs/"' in html
    assert "Run a command" not in html  # Viewers do not run commands.


def test_the_job_list_polls_only_while_a_listed_job_is_active(viewer_client, node):
    job = make_command_job(node, ["true"])
    assert 'hx-trigger="every 2s' in viewer_client.get(reverse("jobs:list")).content.decode()
    job.finish(JobState.SUCCEEDED)
    assert "every 2s" not in viewer_client.get(reverse("jobs:list")).content.decode()


def test_the_job_list_filters_by_state_kind_and_node(viewer_client, node):
    other = NodeFactory(name="cellar")
    wanted = make_command_job(node, ["true"])
    make_command_job(other, ["true"])
    Job.objects.create(kind="probe", node=node)
    response = viewer_client.get(
        reverse("jobs:list"), {"kind": "command", "node": "attic", "state": "queued"}
    )
    assert [job.pk for job in response.context["jobs"]] == [wanted.pk]


def test_htmx_requests_for_the_list_get_only_the_table(viewer_client, node):
    make_command_job(node, ["true"])
    html = viewer_client.get(reverse("jobs:list"), headers={"HX-Request": "true"}).content.decode()
    assert html.lstrip().startswith('<div id="job-table"')
    assert "<html" not in html


def test_strangers_and_anonymous_users_see_no_jobs(client, stranger_user, node):
    job = make_command_job(node, ["true"])
    assert client.get(reverse("jobs:detail", args=[job.pk])).status_code == 302  # To the login page.
    client.force_login(stranger_user)
    assert client.get(reverse("jobs:list")).status_code == 403
    assert client.get(reverse("jobs:detail", args=[job.pk])).status_code == 403
    assert client.get(reverse("jobs:log_download", args=[job.pk])).status_code == 403


def test_the_detail_page_shows_the_tail_of_a_long_log_and_connects_live_after_it(viewer_client, ssh_node):
    job = make_command_job(ssh_node, ["seq", "1", "2000"])
    job.mark_running("w1")
    add_lines(job, 2000)
    html = viewer_client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert html.count('data-seq="') == 500
    assert '<div class="out" data-seq="1999">line 1999</div>' in html
    assert 'data-seq="1499"' not in html
    assert f'ws-connect="/ws/jobs/{job.pk}/?after=1999"' in html
    assert "?before=1500" in html and "Load earlier lines" in html
    # Polls only while the socket is down, from the last line shown (static/js/jobs.js: no eval).
    assert f'hx-trigger="every 2s" hx-swap="outerHTML"\n  data-poll-unless-live="{job.pk}"' in html
    assert f'data-after-cursor="{job.pk}"' in html


def test_load_earlier_lines_returns_the_previous_window_and_its_own_control(viewer_client, ssh_node):
    job = make_command_job(ssh_node, ["true"])
    add_lines(job, 1200)
    url = reverse("jobs:detail", args=[job.pk])
    html = viewer_client.get(url, {"before": 700}, headers={"HX-Request": "true"}).content.decode()
    # The lines go in at the top of the log; the control above the log replaces itself out of band.
    assert html.startswith('<div class="out" data-seq="200">')
    assert f'id="load-earlier-{job.pk}"' in html and "before=200" in html
    assert 'hx-swap-oob="outerHTML"' in html
    assert 'data-seq="200"' in html and 'data-seq="699"' in html and 'data-seq="700"' not in html
    first = viewer_client.get(url, {"before": 200}, headers={"HX-Request": "true"}).content.decode()
    assert "Load earlier lines" not in first and first.count("data-seq=") == 200
    assert f'<span id="load-earlier-{job.pk}" hx-swap-oob="delete"></span>' in first


def test_a_finished_job_neither_polls_nor_connects(viewer_client, ssh_node):
    job = make_command_job(ssh_node, ["true"])
    add_lines(job, 3)
    job.finish(JobState.SUCCEEDED, exit_code=0, result="true exited with status 0.")
    html = viewer_client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert "ws-connect" not in html and "every 2s" not in html
    assert "true exited with status 0." in html


def test_the_polling_fallback_returns_the_summary_and_only_new_lines(viewer_client, ssh_node):
    job = make_command_job(ssh_node, ["true"])
    job.mark_running("w1")
    add_lines(job, 10)
    url = reverse("jobs:detail", args=[job.pk])
    html = viewer_client.get(url, {"after": 6}, headers={"HX-Request": "true"}).content.decode()
    assert html.lstrip().startswith(f'<section class="panel job-summary" id="job-summary-{job.pk}"')
    assert f'<div hx-swap-oob="beforeend:#job-log-{job.pk}">' in html
    assert [s for s in ("6", "7", "8", "9") if f'data-seq="{s}"' in html] == ["7", "8", "9"]
    job.finish(JobState.SUCCEEDED)
    done = viewer_client.get(url, {"after": 9}, headers={"HX-Request": "true"}).content.decode()
    assert "every 2s" not in done and "hx-swap-oob" not in done  # Polling stops; nothing new to add.


def test_ansi_colour_codes_never_reach_the_page_or_the_download(viewer_client, ssh_node):
    job = make_command_job(ssh_node, ["make"])
    job.append_lines([("out", "\x1b[1;32m[ 50%]\x1b[0m Building <llama.cpp>"), ("err", "50%\r100%\x1b[K")])
    job.finish(JobState.SUCCEEDED)
    html = viewer_client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert "\x1b" not in html and "[0m" not in html
    assert "[ 50%] Building &lt;llama.cpp&gt;" in html
    assert '<div class="err" data-seq="1">100%</div>' in html
    response = viewer_client.get(reverse("jobs:log_download", args=[job.pk]))
    body = b"".join(response.streaming_content).decode()
    assert body.splitlines()[-2:] == ["[ 50%] Building <llama.cpp>", "100%"]


def test_the_download_is_the_whole_log_as_text_in_order(viewer_client, ssh_node):
    job = make_command_job(ssh_node, ["seq", "12000"])
    add_lines(job, 12_000, text="{i}")
    response = viewer_client.get(reverse("jobs:log_download", args=[job.pk]))
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="ramdeck-job-{job.pk}-command.log"'
    assert b"".join(response.streaming_content).decode().splitlines() == [str(i) for i in range(12_000)]


def test_an_operator_cancels_a_queued_job_and_it_is_audited(operator_client, operator_user, node):
    job = make_command_job(node, ["sleep", "100"])
    response = operator_client.post(reverse("jobs:cancel", args=[job.pk]))
    assert response.status_code == 302
    job.refresh_from_db()
    assert job.state == JobState.CANCELLED
    event = AuditEvent.objects.get(action="job.cancel")
    assert event.actor == operator_user and event.object_id == str(job.pk)


def test_cancelling_a_running_job_asks_its_runner_and_shows_cancelling(operator_client, node):
    job = make_command_job(node, ["sleep", "100"])
    job.mark_running("w1")
    html = operator_client.post(
        reverse("jobs:cancel", args=[job.pk]), headers={"HX-Request": "true"}
    ).content.decode()
    job.refresh_from_db()
    assert job.state == JobState.RUNNING and job.cancel_requested
    assert "Cancelling…" in html


def test_viewers_cannot_cancel_and_get_no_button(viewer_client, node):
    job = make_command_job(node, ["sleep", "100"])
    assert 'id="cancel-job"' not in viewer_client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert viewer_client.post(reverse("jobs:cancel", args=[job.pk])).status_code == 403
    job.refresh_from_db()
    assert job.state == JobState.QUEUED
    assert AuditEvent.objects.filter(action="permission_denied").exists()


def test_cancel_needs_post(operator_client, node):
    job = make_command_job(node, ["sleep", "100"])
    assert operator_client.get(reverse("jobs:cancel", args=[job.pk])).status_code == 405


def test_operators_see_the_cancel_button_on_an_active_job(operator_client, ssh_node):
    job = make_command_job(ssh_node, ["sleep", "100"])
    assert 'id="cancel-job"' in operator_client.get(reverse("jobs:detail", args=[job.pk])).content.decode()


def test_an_operator_runs_a_command_line_split_like_a_shell(
    operator_client, operator_user, ssh_node, monkeypatch, django_capture_on_commit_callbacks
):
    sent = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: sent.append(job.pk))
    with django_capture_on_commit_callbacks(execute=True):
        response = operator_client.post(
            reverse("run_command"), {"node": "cellar", "command": "ls -la '/var/log/my dir'", "timeout": "60"}
        )
    job = Job.objects.get()
    assert response.status_code == 302 and response["Location"] == job.get_absolute_url()
    assert job.kind == "command" and job.node == ssh_node and job.created_by == operator_user
    assert job.params == {"argv": ["ls", "-la", "/var/log/my dir"], "timeout": 60}
    assert sent == [job.pk]
    event = AuditEvent.objects.get(action="job.create")
    assert event.changes["argv"] == ["ls", "-la", "/var/log/my dir"] and event.changes["node"] == "cellar"


@pytest.mark.security
def test_the_command_timeout_cannot_exceed_the_job_time_limit(
    operator_client, ssh_node, settings, monkeypatch
):
    """The runner stops a command job at the job time limit whatever its own timeout: the form refuses a
    longer one and names the most it takes; nothing is created or enqueued."""
    monkeypatch.setattr(Job, "send_to_worker", lambda job: pytest.fail("nothing should be enqueued"))
    settings.RAMDECK_JOB_TIME_LIMIT_S = 3600
    url = reverse("run_command")
    assert 'max="3600"' in operator_client.get(url).content.decode()
    response = operator_client.post(url, {"node": "cellar", "command": "sleep 5000", "timeout": "3601"})
    assert response.status_code == 200
    errors = response.context["form"].errors["timeout"]
    assert errors == [
        "At most 3600 seconds: a command job is stopped at the job time limit "
        "(3600 s, RAMDECK_JOB_SOFT_TIME_LIMIT) whatever its own timeout says."
    ]
    assert "At most 3600 seconds" in response.content.decode()
    assert not Job.objects.exists() and not AuditEvent.objects.filter(action="job.create").exists()
    # A kind with a shorter limit of its own (jobs/kinds.py) lowers the most the form takes.
    from jobs import kinds

    command = kinds.get("command")
    monkeypatch.setitem(kinds._KINDS, "command", dataclasses.replace(command, time_limit=600))
    response = operator_client.post(url, {"node": "cellar", "command": "sleep 5000", "timeout": "601"})
    assert "At most 600 seconds" in response.context["form"].errors["timeout"][0]
    monkeypatch.setattr(Job, "send_to_worker", lambda job: True)
    response = operator_client.post(url, {"node": "cellar", "command": "sleep 500", "timeout": "600"})
    assert response.status_code == 302 and Job.objects.get().params["timeout"] == 600


def test_an_operator_cannot_run_a_command_on_the_consoles_own_host(
    operator_client, node, ssh_node, monkeypatch
):
    monkeypatch.setattr(Job, "send_to_worker", lambda job: pytest.fail("nothing should be enqueued"))
    form_html = operator_client.get(reverse("run_command")).content.decode()
    assert '<option value="cellar">' in form_html and 'value="attic"' not in form_html
    response = operator_client.post(
        reverse("run_command"), {"node": "attic", "command": "cat var/encryption_key"}
    )
    assert response.status_code == 403
    assert not Job.objects.exists()
    event = AuditEvent.objects.get(action="permission_denied")
    assert event.changes["needed"] == "admin" and event.changes["method"] == "POST"


def test_an_admin_may_run_a_command_on_the_consoles_own_host(
    admin_client, node, monkeypatch, django_capture_on_commit_callbacks
):
    monkeypatch.setattr(Job, "send_to_worker", lambda job: None)
    assert 'value="attic"' in admin_client.get(reverse("run_command")).content.decode()
    with django_capture_on_commit_callbacks(execute=True):
        response = admin_client.post(reverse("run_command"), {"node": "attic", "command": "id"})
    job = Job.objects.get()
    assert response.status_code == 302 and job.node == node and job.params == {"argv": ["id"]}
    assert not AuditEvent.objects.filter(action="permission_denied").exists()


def test_an_unbalanced_quote_is_a_form_error_and_runs_nothing(operator_client, ssh_node, monkeypatch):
    monkeypatch.setattr(Job, "send_to_worker", lambda job: pytest.fail("nothing should be enqueued"))
    response = operator_client.post(reverse("run_command"), {"node": "cellar", "command": "echo 'oops"})
    assert response.status_code == 200
    assert "cannot be split into arguments" in response.content.decode()
    assert not Job.objects.exists()


def test_viewers_cannot_run_commands(viewer_client, node):
    assert viewer_client.get(reverse("run_command")).status_code == 403
    assert viewer_client.post(reverse("run_command"), {"node": "attic", "command": "id"}).status_code == 403
    assert not Job.objects.exists()


def test_the_run_form_preselects_the_node_from_the_query(operator_client, ssh_node):
    html = operator_client.get(reverse("run_command"), {"node": "cellar"}).content.decode()
    assert '<option value="cellar" selected>' in html


def test_job_pages_link_the_node_and_the_starter(admin_client, node):
    starter = UserFactory(username="olga", role="admin")  # the node is the console's own host
    job = Job.objects.create(kind="command", node=node, created_by=starter, params={"argv": ["id"]})
    html = admin_client.get(reverse("jobs:detail", args=[job.pk])).content.decode()
    assert node.get_absolute_url() in html and "olga" in html


def test_a_runs_steps_are_grouped_under_it_in_the_job_list(viewer_client, node):
    run = Job.objects.create(kind="deploy", node=node, title="Deploy tiny", state=JobState.FAILED)
    reap = Job.objects.create(kind="reap", node=node, parent=run, state=JobState.SUCCEEDED)
    start = Job.objects.create(
        kind="rpc_server", node=node, parent=run, state=JobState.FAILED, result="port taken"
    )
    skipped = Job.objects.create(kind="verify", node=node, parent=run, state=JobState.CANCELLED)
    alone = make_command_job(node, ["true"])
    response = viewer_client.get(reverse("jobs:list"))
    # Only top-level jobs are rows of their own; the steps are listed under their run, in order.
    assert [job.pk for job in response.context["jobs"]] == [alone.pk, run.pk]
    html = response.content.decode()
    group = html.split(f'id="job-steps-{run.pk}"')[1].split("</tr>")[0]
    assert "<details open>" in group and "3 steps of" in group  # a failed run's steps show at once
    positions = [group.index(f'id="job-row-{step.pk}"') for step in (reap, start, skipped)]
    assert positions == sorted(positions)
    assert f'id="job-badge-{start.pk}" class="badge failed"' in group and "port taken" in group
    assert f'id="job-steps-{alone.pk}"' not in html  # a job without steps has no group


def test_a_succeeded_runs_steps_are_folded_and_a_filter_finds_runs_by_their_steps(viewer_client, node):
    run = Job.objects.create(kind="deploy", node=node, state=JobState.SUCCEEDED)
    Job.objects.create(kind="reap", node=node, parent=run, state=JobState.SUCCEEDED)
    other = Job.objects.create(kind="deploy", node=node, state=JobState.SUCCEEDED)
    html = viewer_client.get(reverse("jobs:list")).content.decode()
    group = html.split(f'id="job-steps-{run.pk}"')[1].split("</tr>")[0]
    assert "<details>" in group and "1 step of" in group
    # Filtering by a step's kind lists the run it belongs to (the step itself is not a row of its own).
    found = viewer_client.get(reverse("jobs:list"), {"kind": "reap"}).context["jobs"]
    assert [job.pk for job in found] == [run.pk] and other.pk not in [job.pk for job in found]
