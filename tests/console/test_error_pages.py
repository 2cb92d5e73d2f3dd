"""The 403 (and its CSRF variant), 404 and 500 pages are the console's own (pytest-django runs with
DEBUG=False, as production does)."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.contrib.staticfiles import finders
from django.test import Client, RequestFactory
from django.urls import reverse

pytestmark = pytest.mark.django_db


def test_a_missing_page_gets_the_styled_404_with_the_path_and_a_way_back(admin_client):
    assert not settings.DEBUG
    response = admin_client.get("/nodes/no-such-node/")
    assert response.status_code == 404
    body = response.content.decode()
    assert 'id="error-404"' in body
    assert "/nodes/no-such-node/" in body
    assert 'href="/"' in body and "Back to the dashboard" in body
    assert 'rel="icon"' in body  # it is a page of the console: base.html, favicon and navigation
    assert 'id="menu-toggle"' in body


def test_a_404_for_someone_not_logged_in_shows_no_navigation(client):
    response = client.get("/there/is/nothing/here/")
    assert response.status_code == 404
    body = response.content.decode()
    assert 'id="error-404"' in body and 'id="site-menu"' not in body


def test_a_viewer_refused_an_operator_page_gets_the_styled_403_naming_the_role(viewer_client, viewer_user):
    response = viewer_client.get(reverse("run_command"))
    assert response.status_code == 403
    body = response.content.decode()
    assert 'id="error-403"' in body
    assert "This needs the operator role." in body
    assert viewer_user.get_username() in body and "viewer" in body


def test_the_500_page_renders_without_a_request_context():
    # Django's server_error view renders 500.html with an empty context; it must not need one.
    from django.views.defaults import server_error

    response = server_error(RequestFactory().get("/"))
    assert response.status_code == 500
    body = response.content.decode()
    assert 'id="error-500"' in body and "favicon.svg" in body


def test_the_favicon_is_an_svg_that_every_page_links(client):
    path = finders.find("img/favicon.svg")
    assert path is not None
    with open(path) as handle:
        assert handle.read().startswith("<svg")
    assert 'href="/static/img/favicon.svg"' in client.get(reverse("login")).content.decode()


def test_a_form_sent_without_its_csrf_token_gets_the_styled_page_and_changes_nothing(admin_user):
    from nodes.models import Node

    client = Client(enforce_csrf_checks=True)
    client.force_login(admin_user)
    response = client.post(reverse("nodes:create"), {"name": "sneaky", "address": "192.0.2.9"})
    assert response.status_code == 403
    body = response.content.decode()
    assert 'id="error-403-csrf"' in body and "This form has expired" in body
    assert not Node.objects.filter(name="sneaky").exists()
