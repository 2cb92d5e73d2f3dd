"""The role matrix: every route of the URL configuration and every websocket route, for each of anonymous,
viewer, chat, operator and admin, against the outcome that RULES (below, the one table) says. The routes
come from `get_resolver()` and from the ASGI application's websocket router, so a route added without a
rule fails `test_every_route_has_a_rule` (and its own matrix cells) with its name.

Pages are fetched with GET; routes that only take POST (Django's `require_POST`) are sent an empty POST,
which is enough to tell "refused" from "let through" (a let-through POST re-renders its form with errors,
redirects to what it started, or says what is missing). Outcomes: "login" is a redirect to a login page
(the console's or the admin's), a number is the HTTP status.
"""

from __future__ import annotations

from html.parser import HTMLParser
from urllib.parse import urlparse

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.db import transaction
from django.test import Client
from django.urls import Resolver404, URLPattern, resolve, reverse

from deployments.models import Deployment, StaleProcess
from jobs.models import Job, JobState
from modelfiles.models import ModelFile
from nodes.models import Transport
from ramdeck_site.asgi import application
from tests.factories import NodeFactory, UserFactory
from tests.site.routes import HTTP_ROUTES, ROLES, WS_ROUTES, url_of

pytestmark = pytest.mark.security

LOGIN = "login"


def _all(outcome):
    return dict.fromkeys(ROLES, outcome)


def _rule(anonymous, viewer, operator, admin, *, chat=None):
    """The chat role is a viewer who may also chat: it gets the viewer's outcome unless `chat` says."""
    chat = viewer if chat is None else chat
    return {"anonymous": anonymous, "viewer": viewer, "chat": chat, "operator": operator, "admin": admin}


# Route → role → outcome. Websocket routes are keyed by their path pattern ("ws/...").
# Django's admin (user management) is the admin role's: the others get its login page.
_ADMIN_ONLY_PAGE = _rule(LOGIN, LOGIN, LOGIN, 200)
RULES: dict[str, dict[str, object]] = {
    # Site pages.
    "dashboard": _rule(LOGIN, 200, 200, 200),
    "dashboard_live": _rule(LOGIN, 200, 200, 200),  # the dashboard's regions, polled while its socket is down
    "login": _all(302) | {"anonymous": 200},  # logged in: on to the dashboard
    "logout": _rule(LOGIN, 302, 302, 302),  # POST
    "password_change": _rule(LOGIN, 200, 200, 200),
    "password_change_done": _rule(LOGIN, 302, 302, 302),
    "audit": _rule(LOGIN, 200, 200, 200),
    "help": _rule(LOGIN, 200, 200, 200),  # the words of the console, explained
    # Users and their roles: admins only.
    "users:list": _rule(LOGIN, 403, 403, 200),
    "users:create": _rule(LOGIN, 403, 403, 200),
    "users:edit": _rule(LOGIN, 403, 403, 200),
    "users:unlock": _rule(LOGIN, 403, 403, 302),  # POST; ends an account's login lockout
    # Nodes: viewers look, admins change the inventory, operators start probes and calibrations.
    "nodes:list": _rule(LOGIN, 200, 200, 200),
    "nodes:create": _rule(LOGIN, 403, 403, 200),
    "nodes:add_this_machine": _rule(LOGIN, 403, 403, 302),  # POST; the console's own host: admins only
    "calibration:all": _rule(LOGIN, 403, 302, 302),
    "nodes:credentials": _rule(LOGIN, 200, 200, 200),
    "nodes:credential_create": _rule(LOGIN, 403, 403, 200),
    "nodes:credential_edit": _rule(LOGIN, 403, 403, 200),
    "nodes:credential_delete": _rule(LOGIN, 403, 403, 302),
    "nodes:detail": _rule(LOGIN, 200, 200, 200),
    "nodes:edit": _rule(LOGIN, 403, 403, 200),
    "nodes:delete": _rule(LOGIN, 403, 403, 200),
    "nodes:hardware": _rule(LOGIN, 302, 302, 302),  # an htmx fragment; a plain GET goes to the node page
    "nodes:probe": _rule(LOGIN, 403, 302, 302),
    "calibration:node": _rule(LOGIN, 403, 302, 302),
    "nodes:rpc_cache_read": _rule(LOGIN, 403, 302, 302),  # POST; a job reads the RPC cache's size
    "nodes:rpc_cache_clear": _rule(LOGIN, 403, 200, 200),  # the question; its POST clears the cache
    "calibration:figures": _rule(LOGIN, 403, 403, 200),
    "nodes:approve_host_key": _rule(LOGIN, 403, 403, 302),
    # Jobs: viewers read logs, operators run commands and cancel.
    "run_command": _rule(LOGIN, 403, 200, 200),
    "jobs:list": _rule(LOGIN, 200, 200, 200),
    # The matrix's job ran on the console's own host (desk): its log is the admins'. Other nodes' logs are
    # for viewers (tests/jobs/test_job_views.py).
    "jobs:detail": _rule(LOGIN, 403, 403, 200),
    "jobs:log_download": _rule(LOGIN, 403, 403, 200),
    "jobs:cancel": _rule(LOGIN, 403, 302, 302),
    # Models, plans, deployments, builds, stale processes.
    "modelfiles:list": _rule(LOGIN, 200, 200, 200),
    "modelfiles:detail": _rule(LOGIN, 200, 200, 200),  # the model's file, its copies; operators copy it
    "modelfiles:register": _rule(LOGIN, 403, 400, 400),
    "modelfiles:download": _rule(LOGIN, 403, 400, 400),
    "modelfiles:try_real": _rule(LOGIN, 403, 400, 400),
    "modelfiles:copy": _rule(LOGIN, 403, 302, 302),  # POST; an empty form goes back with its error
    "deployments:plan": _rule(LOGIN, 200, 200, 200),
    "deployments:confirm": _rule(LOGIN, 403, 302, 302),  # an empty form: back to the plan page
    "deployments:manual": _rule(LOGIN, 403, 400, 400),  # an empty split by hand: the page with its errors
    "deployments:list": _rule(LOGIN, 200, 200, 200),
    "deployments:detail": _rule(LOGIN, 200, 200, 200),
    "deployments:run": _rule(LOGIN, 200, 200, 200),
    "deployments:processes": _rule(LOGIN, 200, 200, 200),
    # The matrix's deployment uses the console's own host (desk): its API key, RPC mode and self-healing are
    # the admins'; on other nodes, the operators' (tests/nodes/test_console_host_safety.py).
    "deployments:api_key": _rule(LOGIN, 403, 403, 200),  # chat: the console's own host's key is the admins'
    "deployments:deploy": _rule(LOGIN, 403, 302, 302),
    "deployments:stop": _rule(LOGIN, 403, 200, 200),  # GET asks first; only a POST with confirm stops
    "chat:deployment": _rule(LOGIN, 403, 409, 409, chat=409),  # POST; the matrix's deployment is not running
    "chat:page": _rule(LOGIN, 200, 200, 200, chat=200),  # viewers are told who may chat
    "deployments:rpc_mode": _rule(LOGIN, 403, 403, 302),  # POST; back to the run page with a message
    "deployments:restart": _rule(LOGIN, 403, 302, 302),
    "deployments:recalibrate": _rule(LOGIN, 403, 302, 302),  # an empty form: back with "choose a node"
    "deployments:redeploy": _rule(LOGIN, 403, 302, 302),
    "deployments:delete": _rule(LOGIN, 403, 200, 200),  # GET asks first; only a POST with confirm deletes
    "deployments:self_heal": _rule(LOGIN, 403, 403, 302),
    "builds:node": _rule(LOGIN, 200, 200, 200),
    "builds:start": _rule(LOGIN, 403, 400, 400),  # the form again, with errors
    "deployments:stale": _rule(LOGIN, 200, 200, 200),
    "deployments:stale_reap": _rule(LOGIN, 403, 302, 302),
    # Django's admin.
    "admin:index": _ADMIN_ONLY_PAGE,
    "admin:login": _rule(200, 200, 200, 302),
    "admin:logout": _rule(LOGIN, 302, 302, 302),  # POST: logging out is no privilege
    "admin:password_change": _ADMIN_ONLY_PAGE,
    "admin:password_change_done": _ADMIN_ONLY_PAGE,
    "admin:autocomplete": _rule(LOGIN, LOGIN, LOGIN, 403),  # no autocomplete fields anywhere
    "admin:jsi18n": _ADMIN_ONLY_PAGE,
    "admin:view_on_site": _rule(LOGIN, LOGIN, LOGIN, 404),  # users have no page on the site
    "admin:app_list": _ADMIN_ONLY_PAGE,
    "admin/(?P<url>.*)$": _rule(LOGIN, LOGIN, LOGIN, 404),  # the admin's catch-all
    "admin:auth_group_changelist": _ADMIN_ONLY_PAGE,
    "admin:auth_group_add": _ADMIN_ONLY_PAGE,
    "admin:auth_group_history": _ADMIN_ONLY_PAGE,
    "admin:auth_group_delete": _ADMIN_ONLY_PAGE,
    "admin:auth_group_change": _ADMIN_ONLY_PAGE,
    "admin/auth/group/<path:object_id>/": _rule(LOGIN, LOGIN, LOGIN, 302),
    "admin:auth_user_password_change": _ADMIN_ONLY_PAGE,
    "admin:auth_user_changelist": _ADMIN_ONLY_PAGE,
    "admin:auth_user_add": _ADMIN_ONLY_PAGE,
    "admin:auth_user_history": _ADMIN_ONLY_PAGE,
    "admin:auth_user_delete": _ADMIN_ONLY_PAGE,
    "admin:auth_user_change": _ADMIN_ONLY_PAGE,
    "admin/auth/user/<path:object_id>/": _rule(LOGIN, LOGIN, LOGIN, 302),
    # Axes' lockout records: the admin role holds no permission on them (Django's own superuser would).
    "admin:axes_accessattempt_changelist": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:axes_accessattempt_add": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:axes_accessattempt_history": _rule(LOGIN, LOGIN, LOGIN, 302),
    "admin:axes_accessattempt_delete": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:axes_accessattempt_change": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin/axes/accessattempt/<path:object_id>/": _rule(LOGIN, LOGIN, LOGIN, 302),
    "admin:axes_accesslog_changelist": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:axes_accesslog_add": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:axes_accesslog_history": _rule(LOGIN, LOGIN, LOGIN, 302),
    "admin:axes_accesslog_delete": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:axes_accesslog_change": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin/axes/accesslog/<path:object_id>/": _rule(LOGIN, LOGIN, LOGIN, 302),
    "admin:axes_accessfailurelog_changelist": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:axes_accessfailurelog_add": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:axes_accessfailurelog_history": _rule(LOGIN, LOGIN, LOGIN, 302),
    "admin:axes_accessfailurelog_delete": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:axes_accessfailurelog_change": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin/axes/accessfailurelog/<path:object_id>/": _rule(LOGIN, LOGIN, LOGIN, 302),
    # The audit history: readable, never added to, changed or deleted through the admin.
    "admin:audit_auditevent_changelist": _ADMIN_ONLY_PAGE,
    "admin:audit_auditevent_add": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:audit_auditevent_history": _ADMIN_ONLY_PAGE,
    "admin:audit_auditevent_delete": _rule(LOGIN, LOGIN, LOGIN, 403),
    "admin:audit_auditevent_change": _ADMIN_ONLY_PAGE,  # a read-only view of the entry
    "admin/audit/auditevent/<path:object_id>/": _rule(LOGIN, LOGIN, LOGIN, 302),
    # Websockets: anonymous is refused, every role may watch; a job's log on the console's own host (the
    # job of the websocket world below) is the admins'.
    "ws/jobs/": _rule("refused", "accepted", "accepted", "accepted"),
    "ws/jobs/<int:pk>/": _rule("refused", "refused", "refused", "accepted"),
    "ws/deployments/<int:pk>/": _rule("refused", "accepted", "accepted", "accepted"),
    "ws/dashboard/": _rule("refused", "accepted", "accepted", "accepted"),
}


# --- The routes, from the configuration ---------------------------------------------------------------


def test_every_route_has_a_rule():
    keys = [key for key, _ in HTTP_ROUTES] + WS_ROUTES
    missing = [key for key in keys if key not in RULES]
    assert not missing, f"Routes without a rule in RULES (tests/site/test_security_roles.py): {missing}"
    stale = sorted(set(RULES) - set(keys))
    assert not stale, f"Rules for routes that no longer exist: {stale}"
    assert len(keys) == len(set(keys)), "Two routes share a key"
    for key, rule in RULES.items():
        assert set(rule) == set(ROLES), f"{key}: a rule needs an outcome for each of {ROLES}"


# --- A small world for the URL arguments ----------------------------------------------------------------


def inventory() -> tuple:
    """What a refused request must leave as it was (the audit history grows: refusals are recorded)."""
    from django.contrib.auth import get_user_model

    from nodes.models import Credential, Node

    return (
        list(
            Node.objects.order_by("pk").values_list(
                "pk", "address", "host_key", "pending_host_key", "enabled"
            )
        ),
        list(Credential.objects.order_by("pk").values_list("pk", "updated_at")),
        list(Job.objects.order_by("pk").values_list("pk", "state")),
        list(Deployment.objects.order_by("pk").values_list("pk", "state", "self_heal")),
        list(ModelFile.objects.values_list("pk", flat=True)),
        list(StaleProcess.objects.values_list("pk", flat=True)),
        list(get_user_model().objects.order_by("pk").values_list("pk", "password", "is_active")),
    )


def outcome(response) -> object:
    if response.status_code == 302:
        location = response.headers["Location"]
        login_urls = (reverse("login"), reverse("admin:login"))
        if location.split("?")[0] in login_urls and "next=" in location:
            return LOGIN
    return response.status_code


def request_route(client: Client, key: str, pattern: URLPattern, data: dict):
    """GET, or POST where the route refuses GET with 405 (require_POST)."""
    url = url_of(key, pattern, data)
    if client.get(url).status_code == 405:
        return client.post(url, {})
    return client.get(url)


def test_every_route_answers_each_role_as_the_rules_say(db, world):
    """Each (route, role) in a savepoint rolled back after it, so one cell's POST (a deletion, a started
    job) never changes what the next cell finds."""
    wrong = []
    for key, pattern in HTTP_ROUTES:
        if key not in RULES:
            wrong.append(f"{key}: no rule in RULES")
            continue
        for role in ROLES:
            with transaction.atomic():
                client = Client()
                if role != "anonymous":
                    client.force_login(world["users"][role])
                before = inventory()
                got = outcome(request_route(client, key, pattern, world))
                changed = inventory() != before
                transaction.set_rollback(True)
            if got != RULES[key][role]:
                wrong.append(f"{key} as {role}: got {got}, the rule says {RULES[key][role]}")
            elif got in (LOGIN, 403) and changed:
                wrong.append(f"{key} as {role}: refused ({got}), yet something changed")
    assert not wrong, "Routes answering otherwise than RULES says:\n" + "\n".join(wrong)


# --- What each role is offered ------------------------------------------------------------------------------


class _Offers(HTMLParser):
    """Every URL a page offers (links, forms, htmx requests) and every action a link names as where it leads
    (`data-action`, a route name: "Chat with it" jumps to the chat form, "Re-calibrate" to a node page)."""

    def __init__(self):
        super().__init__()
        self.urls: list[tuple[str, str]] = []
        self.actions: list[tuple[str, str]] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for name in ("href", "action", "hx-get", "hx-post", "formaction"):
            if attrs.get(name):
                self.urls.append((f"<{tag} {name}>", attrs[name]))
        if attrs.get("data-action"):
            self.actions.append((f"<{tag} data-action>", attrs["data-action"]))


def _route_key(url: str) -> str | None:
    path = urlparse(url).path
    if not path.startswith("/") or path.startswith("/static/"):
        return None
    try:
        match = resolve(path)
    except Resolver404:
        return None
    return match.view_name if match.url_name else None


def _pages_for(role: str) -> list[tuple[str, URLPattern]]:
    """The pages (GET, 200 by RULES) a role opens, outside Django's admin (Django's own templates)."""
    return [(key, pattern) for key, pattern in HTTP_ROUTES
            if RULES.get(key, {}).get(role) == 200 and not key.startswith("admin")]  # fmt: skip


def _offered_refusals(world) -> list[str]:
    wrong = []
    for role in ROLES[1:]:
        client = Client()
        client.force_login(world["users"][role])
        for key, pattern in _pages_for(role):
            url = url_of(key, pattern, world)
            response = client.get(url)
            if response.status_code != 200 or "html" not in response.headers.get("Content-Type", ""):
                continue
            offers = _Offers()
            offers.feed(response.content.decode())
            targets = [(what, _route_key(target), target) for what, target in offers.urls]
            targets += [(what, route, route) for what, route in offers.actions]
            for what, route, target in targets:
                if route in RULES and RULES[route][role] in (LOGIN, 403):
                    wrong.append(f"{key} as {role}: {what} {target} ({route}: {RULES[route][role]})")
    return wrong


def test_the_may_filter_asks_the_role_each_view_declares_and_refuses_unknown_routes(db):
    from ramdeck_site.roles import route_roles
    from ramdeck_site.templatetags.ramdeck import may

    assert route_roles()["chat:deployment"] == "chat" and route_roles()["deployments:stop"] == "operator"
    chat = UserFactory(username="kid", role="chat")
    assert may(chat, "chat:deployment") and may(chat, "deployments:api_key")
    assert not may(chat, "deployments:stop") and not may(chat, "calibration:node")
    assert not may(None, "chat:deployment")
    with pytest.raises(ValueError, match="No route named 'deployments:chat'"):
        may(chat, "deployments:chat")


def test_no_page_offers_a_role_a_link_or_a_form_that_refuses_it(db, world):
    """Every page each role may open, rendered as that role: no link, form or htmx request on it leads to a
    route RULES says refuses that role. Once as the world is (a confirmed deployment), once with the
    deployment running and slower than predicted (the endpoint, the chat, the advice to re-calibrate)."""
    wrong = _offered_refusals(world)
    deployment = world["deployment"]
    predicted = deployment.plan["predicted_tokens_per_s"]
    Deployment.objects.filter(pk=deployment.pk).update(state="running", measured_decode_tps=predicted / 4)
    running = _offered_refusals(world)
    assert not wrong + running, "Pages offering what refuses the role:\n" + "\n".join(wrong + running)
    # The running deployment's page did offer the running actions to those who may use them.
    pages = {}
    for role in ("viewer", "chat", "operator", "admin"):
        client = Client()
        client.force_login(world["users"][role])
        pages[role] = client.get(reverse("deployments:run", args=[deployment.pk])).content.decode()
    assert "Chat with it" not in pages["viewer"] and "Re-calibrate" not in pages["viewer"]
    assert "Chat with it" in pages["chat"] and 'id="chat-form"' in pages["chat"]
    assert "Re-calibrate" not in pages["chat"] and 'id="stop-button"' not in pages["chat"]
    # It runs on desk, the console's own host: stopping it is the admins'; an operator is told so instead.
    assert "Re-calibrate" in pages["operator"] and 'id="stop-button"' not in pages["operator"]
    assert "desk is the console&#x27;s own host" in pages["operator"].split('id="admins-only"', 1)[1]
    assert 'id="stop-button"' in pages["admin"] and 'id="admins-only"' not in pages["admin"]


# --- Websockets -------------------------------------------------------------------------------------------


def _session_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("route", WS_ROUTES)
async def test_websocket_route_answers_each_role_as_the_rules_say(route, tmp_path):
    assert route in RULES, f"Websocket route {route} has no rule in RULES (tests/site/test_security_roles.py)"
    data = await database_sync_to_async(_ws_world)()
    path = "/" + route.replace("<int:pk>", str(data["pk_for"](route)))
    got = {}
    for role in ROLES:
        headers = [(b"origin", b"http://127.0.0.1")]
        if role != "anonymous":
            cookie = await database_sync_to_async(_session_cookie)(data["users"][role])
            headers.append((b"cookie", f"{settings.SESSION_COOKIE_NAME}={cookie}".encode()))
        communicator = WebsocketCommunicator(application, path, headers=headers)
        connected, _ = await communicator.connect(timeout=15)
        got[role] = "accepted" if connected else "refused"
        await communicator.disconnect()
    assert got == RULES[route], f"{route}: got {got}, the rules say {RULES[route]}"


def _ws_world() -> dict:
    users = {role: UserFactory(username=f"ws-{role}", role=role) for role in ROLES[1:]}
    node = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL)
    job = Job.objects.create(kind="command", node=node, title="echo", state=JobState.RUNNING)
    deployment = Deployment.objects.create(name="d", model_file=ModelFile.objects.create(name="m", node=node),
                                           coordinator=node, plan={})  # fmt: skip

    def pk_for(route: str) -> int:
        return deployment.pk if route.startswith("ws/deployments/") else job.pk

    return {"users": users, "pk_for": pk_for}
