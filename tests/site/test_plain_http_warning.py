"""Forms that take a password or a key warn when the page came over plain HTTP to another machine."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from tests.factories import UserFactory

pytestmark = [pytest.mark.security, pytest.mark.django_db]

WARNING = 'id="plain-http-warning"'


@pytest.mark.parametrize("route", ["nodes:credential_create", "password_change", "login"])
def test_a_lan_client_over_plain_http_is_warned(route):
    admin = UserFactory(username="alice-admin", role="admin")
    lan = Client(REMOTE_ADDR="192.168.1.23")
    loopback = Client(REMOTE_ADDR="127.0.0.1")
    tls = Client(REMOTE_ADDR="192.168.1.23")
    if route != "login":
        for client in (lan, loopback, tls):
            client.force_login(admin)
    page = lan.get(reverse(route)).content.decode()
    assert WARNING in page and "Anyone on your network can read" in page
    assert WARNING not in loopback.get(reverse(route)).content.decode()
    assert WARNING not in tls.get(reverse(route), secure=True).content.decode()


def test_behind_a_tls_proxy_that_says_so_there_is_no_warning(settings):
    settings.SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    client = Client(REMOTE_ADDR="192.168.1.23")
    client.force_login(UserFactory(username="alice-admin", role="admin"))
    page = client.get(reverse("nodes:credential_create"), HTTP_X_FORWARDED_PROTO="https").content.decode()
    assert WARNING not in page
