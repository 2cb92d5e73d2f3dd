"""The 403 (and its CSRF variant), 404 and 500 pages are the console's own (pytest-django runs with
DEBUG=False, as production does)."""

from __future__ import annotations

import logging

import pytest
from django.conf import settings
from django.contrib.staticfiles import finders
from django.test import Client, RequestFactory
from django.urls import reverse

from ramdeck_site.roles import ROLES
from tests.factories import NodeFactory, UserFactory

pytestmark = pytest.mark.django_db

# Addresses no route matches: a typo, what every browser asks for, sub-paths of real pages that do not exist.
UNKNOWN_PATHS = (
    "/nodess/",
    "/favicon.ico",
    "/nodes/vm/builds/",
    "/deployments/1/nothing/",
    "/jobs/abc/",
    "/models/1/plan/extra/",
)
# Every role, a logged-in user in no role, and nobody logged in.
PERSONAS = (*ROLES, "no role", "anonymous")


@pytest.mark.parametrize("persona", PERSONAS)
def test_an_unknown_address_gets_the_styled_404_whoever_asks(persona):
    NodeFactory(name="vm")  # the node exists; its /builds/ sub-path does not
    client = Client(raise_request_exception=False)
    if persona != "anonymous":
        role = None if persona == "no role" else persona
        client.force_login(UserFactory(username=f"who-{persona.replace(' ', '-')}", role=role))
    for path in UNKNOWN_PATHS:
        response = client.get(path)
        assert response.status_code == 404, (persona, path, response.status_code)
        body = response.content.decode()
        assert 'id="error-404"' in body and path in body, (persona, path)
        assert "Back to the dashboard" in body
        # The console's page: base.html with its top bar; the menu only for someone logged in.
        assert 'id="topbar"' in body
        assert ('id="site-menu"' in body) == (persona != "anonymous"), (persona, path)
        assert 'aria-current="page"' not in body  # no section is marked for an address of none


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


def test_a_server_error_is_logged_with_its_traceback_under_the_reference_its_page_shows(
    admin_user, monkeypatch, caplog
):
    def broken(user):
        raise ZeroDivisionError("a bug in the dashboard")

    monkeypatch.setattr("console.views.first_run_context", broken)
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)
    with caplog.at_level(logging.ERROR):
        response = client.get(reverse("dashboard"))
    assert response.status_code == 500
    body = response.content.decode()
    assert 'id="error-500"' in body and "the console's log" in body
    reference = body.split('id="error-reference">', 1)[1].split("<", 1)[0]
    assert len(reference) == 8
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    # Once, with the reference and the traceback (Django's own "Internal Server Error" line is left out).
    assert len(errors) == 1, [r.getMessage() for r in errors]
    (record,) = errors
    assert reference in record.getMessage() and "GET /" in record.getMessage()
    assert record.exc_info and record.exc_info[0] is ZeroDivisionError
    assert "a bug in the dashboard" in caplog.text and "Traceback" in caplog.text


def test_an_error_while_a_404_page_renders_is_logged_with_its_traceback(admin_user, monkeypatch, caplog):
    # Django logs such an error only as "Not Found": the 500 view logs the exception it was handling.
    def broken(request, exception):
        raise RuntimeError("the 404 page itself failed")

    monkeypatch.setattr("ramdeck_site.urls.handler404", broken, raising=False)
    client = Client(raise_request_exception=False)
    client.force_login(admin_user)
    with caplog.at_level(logging.WARNING):
        response = client.get("/no-such-page/")
    assert response.status_code == 500
    reference = response.content.decode().split('id="error-reference">', 1)[1].split("<", 1)[0]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [reference in r.getMessage() for r in errors] == [True]
    assert errors[0].exc_info[0] is RuntimeError


# In a process of its own, with the console's real logging settings: what reaches stderr (the terminal of
# `make run`, `docker compose logs web`), which is where the 500 page sends the reader.
FAILING_404_SCRIPT = """
import django
django.setup()
from django.test import Client
import ramdeck_site.urls

def broken(request, exception):
    raise RuntimeError("the 404 page itself failed")

ramdeck_site.urls.handler404 = broken
response = Client(raise_request_exception=False).get("/no-such-page/", HTTP_HOST="localhost")
body = response.content.decode()
print(response.status_code, body.split('id="error-reference">', 1)[1].split("<", 1)[0])
"""


def test_the_console_log_on_stderr_holds_the_traceback_of_a_server_error():
    import os
    import subprocess
    import sys

    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "ramdeck_site.settings", "LOG_LEVEL": "INFO"}
    result = subprocess.run(
        [sys.executable, "-c", FAILING_404_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=settings.BASE_DIR,
    )
    assert result.returncode == 0, result.stderr
    status, reference = result.stdout.split()
    assert status == "500"
    log = result.stderr
    assert f"ERROR ramdeck_site.errors: Server error {reference}: GET /no-such-page/" in log
    assert "Traceback (most recent call last)" in log and "RuntimeError: the 404 page itself failed" in log
    assert "Not Found: /no-such-page/" not in log  # Django's line that said nothing of the error
