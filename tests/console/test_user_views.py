"""Users and roles inside the console: admins list, add, change roles and deactivate; every change audited;
nobody locks the console out of its last admin."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from audit.models import AuditEvent
from ramdeck_site.roles import role_of
from tests.factories import PASSWORD, UserFactory

pytestmark = pytest.mark.django_db
User = get_user_model()


def test_an_admin_sees_every_user_with_their_role(admin_client, operator_user, viewer_user):
    page = admin_client.get(reverse("users:list")).content.decode()
    assert "oscar-operator" in page and "vera-viewer" in page and "alice-admin" in page
    assert ">operator<" in page and ">viewer<" in page


@pytest.mark.parametrize("who", ["operator_client", "chat_client", "viewer_client"])
def test_only_admins_manage_users(request, who):
    client = request.getfixturevalue(who)
    assert client.get(reverse("users:list")).status_code == 403
    assert client.post(reverse("users:create"), {"username": "mallory"}).status_code == 403
    assert not User.objects.filter(username="mallory").exists()


def test_an_admin_adds_an_operator_who_can_log_in(admin_client):
    response = admin_client.post(
        reverse("users:create"),
        {"username": "olga", "email": "", "role": "operator", "password1": PASSWORD, "password2": PASSWORD},
    )
    assert response.status_code == 302
    olga = User.objects.get(username="olga")
    assert role_of(olga) == "operator"
    event = AuditEvent.objects.get(action="user.create")
    assert event.changes == {"username": "olga", "role": "operator"} and event.actor_name == "alice-admin"
    assert event.sentence == "alice-admin added user olga: role: operator; username: olga"
    assert olga.is_active and olga.check_password(PASSWORD)


def test_an_admin_gives_a_family_member_the_chat_role_and_can_take_it_back(admin_client, viewer_user):
    form = admin_client.get(reverse("users:create")).content.decode()
    assert 'value="chat"' in form and "Chat: a viewer who may also chat" in form
    response = admin_client.post(
        reverse("users:create"),
        {"username": "kid", "email": "", "role": "chat", "password1": PASSWORD, "password2": PASSWORD},
    )
    assert response.status_code == 302
    kid = User.objects.get(username="kid")
    assert role_of(kid) == "chat"
    assert "chat" in admin_client.get(reverse("users:list")).content.decode()
    url = reverse("users:edit", args=[viewer_user.pk])
    assert admin_client.post(url, {"role": "chat", "is_active": "on"}).status_code == 302
    viewer_user.refresh_from_db()
    assert role_of(viewer_user) == "chat"
    assert AuditEvent.objects.filter(action="user.update").last().changes == {"role": ["viewer", "chat"]}
    assert admin_client.post(url, {"role": "viewer", "is_active": "on"}).status_code == 302
    assert role_of(User.objects.get(pk=viewer_user.pk)) == "viewer"


def test_a_weak_or_mismatched_password_re_renders_the_form(admin_client):
    response = admin_client.post(
        reverse("users:create"),
        {"username": "olga", "role": "viewer", "password1": "abc", "password2": "abd"},
    )
    assert response.status_code == 400
    assert "didn’t match" in response.content.decode() or "didn't match" in response.content.decode()
    assert not User.objects.filter(username="olga").exists()


def test_an_admin_changes_a_role_and_deactivates_a_user_audited(admin_client, viewer_user):
    url = reverse("users:edit", args=[viewer_user.pk])
    assert admin_client.post(url, {"role": "operator", "is_active": "on"}).status_code == 302
    viewer_user.refresh_from_db()
    assert role_of(viewer_user) == "operator"
    assert admin_client.post(url, {"role": "operator"}).status_code == 302
    viewer_user.refresh_from_db()
    assert not viewer_user.is_active and role_of(viewer_user) is None
    sentences = [e.sentence for e in AuditEvent.objects.filter(action="user.update").order_by("pk")]
    assert sentences == [
        "alice-admin changed user vera-viewer: role from viewer to operator",
        "alice-admin changed user vera-viewer: active from yes to no",
    ]
    # The list still shows the role a reactivation would give back.
    page = admin_client.get(reverse("users:list")).content.decode()
    assert "deactivated" in page


def test_an_admin_cannot_demote_or_deactivate_themselves(admin_client, admin_user):
    url = reverse("users:edit", args=[admin_user.pk])
    response = admin_client.post(url, {"role": "viewer", "is_active": "on"})
    assert response.status_code == 400 and "your own admin role" in response.content.decode()
    response = admin_client.post(url, {"role": "admin"})
    assert response.status_code == 400
    admin_user.refresh_from_db()
    assert admin_user.is_active and role_of(admin_user) == "admin"
    assert not AuditEvent.objects.filter(action="user.update").exists()


def test_a_superuser_is_always_an_admin_and_other_admins_may_be_demoted(client):
    superuser = User.objects.create_superuser("root-admin", password=PASSWORD)
    other = UserFactory(username="bob-admin", role="admin")
    client.force_login(superuser)
    # Two admins: bob may be demoted.
    assert (
        client.post(reverse("users:edit", args=[other.pk]), {"role": "viewer", "is_active": "on"}).status_code
        == 302
    )
    # The superuser's role is not offered for change: it is always an admin.
    page = client.get(reverse("users:edit", args=[superuser.pk])).content.decode()
    assert "A superuser is always an admin." in page


@pytest.mark.security
@pytest.mark.django_db(transaction=True)
def test_two_admins_demoting_each_other_at_once_leave_one_admin(monkeypatch):
    """The last-admin check and the change are one locked transaction (console/users.py
    `lock_admins`). To make the race certain, each request, once it has counted the admins, waits (up to
    2 s) for the other to have counted too: checked outside the lock, both would count two admins and both
    demotions would go through. Run on SQLite and on PostgreSQL (DATABASE_URL)."""
    import contextlib
    import threading

    from django.db import connection
    from django.test import Client

    from console import users as user_views

    anna = UserFactory(username="anna", role="admin")
    ben = UserFactory(username="ben", role="admin")
    clients = {}
    for admin in (anna, ben):
        clients[admin.username] = Client()
        clients[admin.username].force_login(admin)

    both_counted = threading.Barrier(2)
    count = user_views.active_admin_count

    def count_then_wait_for_the_other() -> int:
        admins = count()
        with contextlib.suppress(threading.BrokenBarrierError):
            both_counted.wait(timeout=2)
        return admins

    monkeypatch.setattr(user_views, "active_admin_count", count_then_wait_for_the_other)
    answers: dict[str, int] = {}

    def demote(by: str, target) -> None:
        try:
            url = reverse("users:edit", args=[target.pk])
            answers[by] = clients[by].post(url, {"role": "viewer", "is_active": "on"}).status_code
        finally:
            connection.close()

    threads = [threading.Thread(target=demote, args=args) for args in (("anna", ben), ("ben", anna))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert sorted(answers.values()) == [302, 400], answers
    assert count() == 1
    assert AuditEvent.objects.filter(action="user.update").count() == 1
