"""Shared fixtures: personas (admin, operator, viewer, stranger) and logged-in clients.

Other fixture modules register themselves through `pytest_plugins` below so each area keeps its own.
"""

from __future__ import annotations

import pytest
from django.test import override_settings

from tests.factories import PASSWORD, UserFactory
from tests.unavailable import in_ci

pytest_plugins: list[str] = [
    "tests.lab.fixtures",
    "tests.browser",
    "tests.job_fixtures",
    "tests.fault_fixtures",
    "tests.household",
    "tests.llamacpp_background",
]


def pytest_collection_modifyitems(config, items):
    """Browser tests last: Playwright's sync API keeps an event loop on the main thread for the rest of the
    session, which would break later tests that start their own (asyncio.run, async_to_sync). Within each
    part, the tests that need llama.cpp after the others, and those that need its Vulkan build after those,
    so a first build runs beside the tests before them (tests/llamacpp_background.py)."""
    # Registered as a plugin above: imported after.
    from tests.llamacpp_background import needs_llamacpp, needs_vulkan

    items.sort(
        key=lambda item: (
            item.get_closest_marker("browser") is not None,
            needs_llamacpp(item),
            needs_vulkan(item),
        )
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a `security` test never skips, whatever asked it to (an xfail counts as a skip too):
    SECURITY.md names these tests as the proof of its promises."""
    report = yield
    if report.skipped and in_ci() and item.get_closest_marker("security") is not None:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid}: a security test may not skip under CI=true ({report.longrepr})"
    return report


@pytest.fixture
def figure(record_property):
    """`figure(name, value)`: a measured figure (a recovery time, a start-up time), printed with the others at
    the end of the run, so a CI log carries them."""

    def record(name: str, value) -> None:
        record_property(f"figure:{name}", value)

    return record


def pytest_terminal_summary(terminalreporter):
    figures = [
        (report.nodeid.split("::")[-1], name.removeprefix("figure:"), value)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "call"
        for name, value in getattr(report, "user_properties", ())
        if name.startswith("figure:")
    ]
    if figures:
        terminalreporter.section("measured figures")
        for test, name, value in figures:
            terminalreporter.write_line(f"{name} = {value}  ({test})")


@pytest.fixture(scope="session", autouse=True)
def _fast_password_hashing():
    """Tests hash passwords with MD5: the console's PBKDF2 (a million rounds, about 0.7 s here, on purpose)
    would cost the suite minutes of test users. tests/console/test_auth_and_audit.py checks what the console
    uses."""
    with override_settings(PASSWORD_HASHERS=["django.contrib.auth.hashers.MD5PasswordHasher"]):
        yield


@pytest.fixture
def password() -> str:
    return PASSWORD


@pytest.fixture
def admin_user(db):
    return UserFactory(username="alice-admin", role="admin")


@pytest.fixture
def operator_user(db):
    return UserFactory(username="oscar-operator", role="operator")


@pytest.fixture
def viewer_user(db):
    return UserFactory(username="vera-viewer", role="viewer")


@pytest.fixture
def chat_user(db):
    """A family member who only chats: a viewer who may also chat with running deployments."""
    return UserFactory(username="cleo-chat", role="chat")


@pytest.fixture
def stranger_user(db):
    """Logged in, but in no role: sees nothing."""
    return UserFactory(username="sam-stranger")


def _client_for(client, user):
    client.force_login(user)
    return client


@pytest.fixture
def admin_client(client, admin_user):
    return _client_for(client, admin_user)


@pytest.fixture
def operator_client(client, operator_user):
    return _client_for(client, operator_user)


@pytest.fixture
def viewer_client(client, viewer_user):
    return _client_for(client, viewer_user)


@pytest.fixture
def chat_client(client, chat_user):
    return _client_for(client, chat_user)


@pytest.fixture(scope="session", autouse=True)
def _end_stray_database_sessions(django_db_setup, django_db_blocker):
    """Before the test database is dropped, end the sessions that other threads and forked servers of this
    run left open on PostgreSQL; otherwise the drop fails and the next run starts with a stale database."""
    yield
    with django_db_blocker.unblock():
        from django.db import connection

        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
