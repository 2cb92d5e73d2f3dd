"""A machine that is switched off: one line on the dashboard ("pc2 offline since 21:40, last seen …") and
one audit entry, not a failed job per periodic probe; beat looks at it less and less often, without a job,
until it answers; deleting a node takes its probe history off the dashboard."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEvent
from audit.sentences import sentence
from jobs import runner
from jobs.models import Job, JobState
from nodes import tasks
from nodes.models import CredentialKind, Node, Reachability
from nodes.probe import job as probe_job
from tests.factories import CredentialFactory, NodeFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(600)]

ROUND = timedelta(seconds=300)  # beat's probe interval, as by default


@pytest.fixture(autouse=True)
def quick_connects_and_queued_jobs(settings, channel_layer, monkeypatch):
    """Beat's jobs are kept, not sent to a worker: the test runs them."""
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 2.0
    settings.RAMDECK_PROBE_INTERVAL_S = int(ROUND.total_seconds())
    settings.RAMDECK_PROBE_BACKOFF_MAX_S = 3600
    monkeypatch.setattr(Job, "send_to_worker", lambda job: True)


def beat_round() -> list[Job]:
    return list(Job.objects.filter(pk__in=tasks.probe_all_nodes()))


def run(job: Job) -> Job:
    runner.run_job(job.pk)
    job.refresh_from_db()
    return job


def offline_line(client, node: Node) -> str:
    body = client.get(reverse("dashboard")).content.decode()
    marker = f'id="offline-{node.name}"'
    return body.split(marker, 1)[1].split("</li>", 1)[0] if marker in body else ""


def failed_panel(client) -> str:
    body = client.get(reverse("dashboard")).content.decode()
    return body.split('id="dash-failed-jobs"', 1)[1].split("</section>", 1)[0]


@pytest.mark.lab
def test_a_node_switched_off_for_the_night_is_one_line_one_audit_entry_and_few_quiet_looks(
    lab, lab_host, admin_client, monkeypatch
):
    credential = CredentialFactory(kind=CredentialKind.PRIVATE_KEY, secret=lab.client_private_key)
    node = NodeFactory(name="pc2", address=lab_host.address, ssh_user="root", credential=credential,
                       host_key=lab_host.host_public_key)  # fmt: skip
    (first,) = beat_round()
    assert run(first).state == JobState.SUCCEEDED, first.result
    node.refresh_from_db()
    assert node.reachability == Reachability.REACHABLE and node.unreachable_since is None

    lab.link_down(lab_host)  # switched off: packets to it vanish
    (failing,) = beat_round()  # it answered last time: a real probe, which finds it gone
    assert run(failing).state == JobState.ERRORED
    node.refresh_from_db()
    assert node.reachability == Reachability.UNREACHABLE and node.unreachable_since is not None
    went = AuditEvent.objects.get(action="node.offline")
    assert went.actor is None and sentence(went).startswith("the console lost contact with node pc2")

    line = offline_line(admin_client, node)
    since = timezone.localtime(node.unreachable_since)
    assert f"pc2 offline since {since:%H:%M}, last seen " in line and " ago" in line
    assert f'id="dash-failed-{failing.pk}"' not in failed_panel(admin_client)  # the line says it already

    # The night: beat's rounds every five minutes for ten hours, on a clock the test moves.
    looks = []
    real_answers = probe_job.answers_again

    def answers(node):
        looks.append(clock.now)
        return real_answers(node)

    class Clock:
        now = timezone.now()

        def __call__(self):
            return self.now

    clock = Clock()
    with pytest.MonkeyPatch.context() as night:
        night.setattr(probe_job, "answers_again", answers)
        night.setattr(timezone, "now", clock)
        start = clock.now
        for _ in range(120):
            clock.now += ROUND
            assert beat_round() == []
        gaps = [round((b - a).total_seconds() / 60) for a, b in zip([start, *looks], looks, strict=False)]
        # The waits double (5, 5, 10, 20, 40 minutes…), then once an hour: a dozen quiet looks, not 120
        # failed jobs.
        assert gaps[:6] == [5, 5, 10, 20, 40, 60], gaps
        assert all(gap <= 65 for gap in gaps) and 10 <= len(looks) <= 16, gaps
        assert Job.objects.filter(node=node, kind="probe").count() == 2
        assert AuditEvent.objects.filter(action="node.offline").count() == 1
        node.refresh_from_db()
        assert node.unreachable_since == went.at or abs(node.unreachable_since - went.at) < timedelta(
            seconds=5
        )

        # It is switched on again: the next look finds it, and only then a probe job is queued.
        lab.link_up(lab_host)
        back = []
        while not back:
            clock.now += ROUND
            back = beat_round()
    (probe,) = back
    assert run(probe).state == JobState.SUCCEEDED, probe.result
    node.refresh_from_db()
    assert node.reachability == Reachability.REACHABLE and node.unreachable_since is None
    came = AuditEvent.objects.get(action="node.online")
    assert came.actor is None and sentence(came).startswith("the console reached node pc2 again")
    assert offline_line(admin_client, node) == ""
    # Back: its failed probe is a fact of the last day again, on the dashboard, until the node is deleted.
    assert f'id="dash-failed-{failing.pk}"' in failed_panel(admin_client)
    response = admin_client.post(reverse("nodes:delete", args=[node.name]))
    assert response.status_code == 302
    assert f'id="dash-failed-{failing.pk}"' not in failed_panel(admin_client)
    assert not Job.objects.filter(kind="probe", node_name="pc2").exists()


def test_deleting_a_node_takes_its_probe_history_off_the_dashboard(admin_client):
    gone = NodeFactory(name="old-laptop")
    kept = NodeFactory(name="desk")
    now = timezone.now()

    def failed_probe(node):
        return Job.objects.create(kind="probe", node=node, node_name=node.name, state=JobState.ERRORED,
                                  finished_at=now, result="cannot connect")  # fmt: skip

    old, other = failed_probe(gone), failed_probe(kept)
    panel = failed_panel(admin_client)
    assert f'id="dash-failed-{old.pk}"' in panel and f'id="dash-failed-{other.pk}"' in panel
    admin_client.post(reverse("nodes:delete", args=[gone.name]))
    panel = failed_panel(admin_client)
    assert f'id="dash-failed-{old.pk}"' not in panel and f'id="dash-failed-{other.pk}"' in panel
    assert not Job.objects.filter(pk=old.pk).exists()


def test_the_wait_between_looks_at_an_offline_node_doubles_up_to_the_limit(settings):
    settings.RAMDECK_PROBE_INTERVAL_S = 300
    settings.RAMDECK_PROBE_BACKOFF_MAX_S = 3600
    since = timezone.now()
    node = Node(name="pc2", unreachable_since=since, last_probe_at=since)
    waits = []
    for _ in range(8):
        due = node.next_probe_at()
        waits.append(round((due - node.last_probe_at).total_seconds() / 60))
        node.last_probe_at = due
    assert waits == [5, 5, 10, 20, 40, 60, 60, 60]
    assert Node(name="desk").next_probe_at() is None  # a node that answers: every round


def _text(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def _banner(client, node: Node) -> str:
    body = client.get(node.get_absolute_url()).content.decode()
    if 'id="unreachable-banner"' not in body:
        return ""
    return body.split('id="unreachable-banner"', 1)[1].split("</div>", 1)[0]


def test_the_node_page_says_since_when_a_node_is_offline_in_the_dashboards_one_line(viewer_client):
    node = NodeFactory(name="pc2", last_seen_at=timezone.now() - timedelta(hours=3),
                       reachability=Reachability.REACHABLE)  # fmt: skip
    assert _banner(viewer_client, node) == ""
    assert node.mark_unreachable("10.77.3.2:22 did not answer within 10 s.\nssh: connect timed out")
    banner = _banner(viewer_client, node)
    since = timezone.localtime(node.unreachable_since)
    sentence = f"pc2 offline since {since:%H:%M}, last seen 3\xa0hours ago"
    assert sentence in banner and "Offline</span>" in banner and "did not answer within 10 s." in banner
    assert "Unreachable." not in banner  # the sentence says it, with since when
    # The same line as the dashboard's, which links to the node page; both keep to one line of reason.
    line = offline_line(viewer_client, node)
    assert sentence in line and f'href="{node.get_absolute_url()}"' in line
    assert _text(line.split(">", 1)[1]) == _text(banner.split(">", 1)[1])
    # A second failure keeps the reason current, not the time it went away.
    node.mark_unreachable("No route to host")
    banner = _banner(viewer_client, node)
    assert sentence in banner and "No route to host" in banner and "did not answer" not in banner
