"""The role matrix: every route of the URL configuration and every websocket route, for each of anonymous,
viewer, operator and admin, against the outcome that RULES (below, the one table) says. The routes come from
`get_resolver()` and from the ASGI application's websocket router, so a route added without a rule fails
`test_every_route_has_a_rule` (and its own matrix cells) with its name.

Pages are fetched with GET; routes that only take POST (Django's `require_POST`) are sent an empty POST,
which is enough to tell "refused" from "let through" (a let-through POST re-renders its form with errors,
redirects to what it started, or says what is missing). Outcomes: "login" is a redirect to a login page
(the console's or the admin's), a number is the HTTP status.
"""

from __future__ import annotations

import pytest
from channels.db import database_sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth.models import Group
from django.contrib.contenttypes.models import ContentType
from django.db import transaction
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, reverse
from django.utils import timezone

from audit import history
from audit.models import AuditEvent
from deployments import gguf_profile
from deployments.models import Deployment, ModelFile, StaleProcess
from deployments.tiny_model import TinyLlama, write_tiny_llama
from jobs.models import Job, JobState
from nodes.models import CredentialKind, DeviceKind, Reachability, Transport
from ramdeck_site.asgi import application
from tests.factories import CredentialFactory, DeviceFactory, NodeFactory, UserFactory

pytestmark = pytest.mark.security

ROLES = ("anonymous", "viewer", "operator", "admin")
LOGIN = "login"


def _all(outcome):
    return dict.fromkeys(ROLES, outcome)


def _rule(anonymous, viewer, operator, admin):
    return {"anonymous": anonymous, "viewer": viewer, "operator": operator, "admin": admin}


# Route → role → outcome. Websocket routes are keyed by their path pattern ("ws/...").
# Django's admin (user management) is the admin role's: the others get its login page.
_ADMIN_ONLY_PAGE = _rule(LOGIN, LOGIN, LOGIN, 200)
RULES: dict[str, dict[str, object]] = {
    # Site pages.
    "dashboard": _rule(LOGIN, 200, 200, 200),
    "dashboard_live": _rule(LOGIN, 200, 200, 200),  # the dashboard's regions, polled while its socket is down
    "login": _all(200) | {"viewer": 302, "operator": 302, "admin": 302},  # logged in: on to the dashboard
    "logout": _rule(LOGIN, 302, 302, 302),  # POST
    "password_change": _rule(LOGIN, 200, 200, 200),
    "password_change_done": _rule(LOGIN, 302, 302, 302),
    "audit": _rule(LOGIN, 200, 200, 200),
    # Users and their roles: admins only.
    "users:list": _rule(LOGIN, 403, 403, 200),
    "users:create": _rule(LOGIN, 403, 403, 200),
    "users:edit": _rule(LOGIN, 403, 403, 200),
    "users:unlock": _rule(LOGIN, 403, 403, 302),  # POST; ends an account's login lockout
    # Nodes: viewers look, admins change the inventory, operators start probes and calibrations.
    "nodes:list": _rule(LOGIN, 200, 200, 200),
    "nodes:create": _rule(LOGIN, 403, 403, 200),
    "nodes:add_this_machine": _rule(LOGIN, 403, 403, 302),  # POST; the console's own host: admins only
    "nodes:calibrate_all": _rule(LOGIN, 403, 302, 302),
    "nodes:credentials": _rule(LOGIN, 200, 200, 200),
    "nodes:credential_create": _rule(LOGIN, 403, 403, 200),
    "nodes:credential_edit": _rule(LOGIN, 403, 403, 200),
    "nodes:credential_delete": _rule(LOGIN, 403, 403, 302),
    "nodes:detail": _rule(LOGIN, 200, 200, 200),
    "nodes:edit": _rule(LOGIN, 403, 403, 200),
    "nodes:delete": _rule(LOGIN, 403, 403, 200),
    "nodes:hardware": _rule(LOGIN, 302, 302, 302),  # an htmx fragment; a plain GET goes to the node page
    "nodes:probe": _rule(LOGIN, 403, 302, 302),
    "nodes:calibrate": _rule(LOGIN, 403, 302, 302),
    "nodes:bandwidth": _rule(LOGIN, 403, 403, 200),
    "nodes:approve_host_key": _rule(LOGIN, 403, 403, 302),
    # Jobs: viewers read logs, operators run commands and cancel.
    "run_command": _rule(LOGIN, 403, 200, 200),
    "jobs:list": _rule(LOGIN, 200, 200, 200),
    # The matrix's job ran on the console's own host (desk): its log is the admins'. Other nodes' logs are
    # for viewers (tests/test_job_views.py).
    "jobs:detail": _rule(LOGIN, 403, 403, 200),
    "jobs:log_download": _rule(LOGIN, 403, 403, 200),
    "jobs:cancel": _rule(LOGIN, 403, 302, 302),
    # Models, plans, deployments, builds, stale processes.
    "deployments:models": _rule(LOGIN, 200, 200, 200),
    "deployments:model_register": _rule(LOGIN, 403, 400, 400),
    "deployments:model_download": _rule(LOGIN, 403, 400, 400),
    "deployments:plan": _rule(LOGIN, 200, 200, 200),
    "deployments:confirm": _rule(LOGIN, 403, 302, 302),  # an empty form: back to the plan page
    "deployments:list": _rule(LOGIN, 200, 200, 200),
    "deployments:detail": _rule(LOGIN, 200, 200, 200),
    "deployments:run": _rule(LOGIN, 200, 200, 200),
    "deployments:processes": _rule(LOGIN, 200, 200, 200),
    # The matrix's deployment uses the console's own host (desk): its API key, RPC mode and self-healing are
    # the admins'; on other nodes, the operators' (tests/test_console_host_safety.py).
    "deployments:api_key": _rule(LOGIN, 403, 403, 200),
    "deployments:deploy": _rule(LOGIN, 403, 302, 302),
    "deployments:stop": _rule(LOGIN, 403, 200, 200),  # GET asks first; only a POST with confirm stops
    "deployments:chat": _rule(LOGIN, 403, 409, 409),  # POST; the matrix's deployment is not running
    "deployments:rpc_mode": _rule(LOGIN, 403, 403, 302),  # POST; back to the run page with a message
    "deployments:restart": _rule(LOGIN, 403, 302, 302),
    "deployments:redeploy": _rule(LOGIN, 403, 302, 302),
    "deployments:self_heal": _rule(LOGIN, 403, 403, 302),
    "deployments:node_builds": _rule(LOGIN, 200, 200, 200),
    "deployments:node_build_start": _rule(LOGIN, 403, 400, 400),  # the form again, with errors
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


def http_routes(resolver=None, namespace: str = "", prefix: str = "") -> list[tuple[str, URLPattern]]:
    """(key, pattern) for every HTTP route: `namespace:name`, or the full path pattern of an unnamed one."""
    routes = []
    for entry in (resolver or get_resolver()).url_patterns:
        if isinstance(entry, URLResolver):
            inner = f"{namespace}{entry.namespace}:" if entry.namespace else namespace
            routes += http_routes(entry, inner, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            key = f"{namespace}{entry.name}" if entry.name else prefix + str(entry.pattern)
            routes.append((key, entry))
    return routes


def websocket_routes() -> list[str]:
    """The path patterns of the URLRouter inside the ASGI application's websocket stack."""
    app = application.application_mapping["websocket"]
    while not isinstance(app, URLRouter):
        app = getattr(app, "application", None) or app.inner
    return [str(route.pattern) for route in app.routes]


HTTP_ROUTES = http_routes()
WS_ROUTES = websocket_routes()


def test_every_route_has_a_rule():
    keys = [key for key, _ in HTTP_ROUTES] + WS_ROUTES
    missing = [key for key in keys if key not in RULES]
    assert not missing, f"Routes without a rule in RULES (tests/test_security_roles.py): {missing}"
    stale = sorted(set(RULES) - set(keys))
    assert not stale, f"Rules for routes that no longer exist: {stale}"
    assert len(keys) == len(set(keys)), "Two routes share a key"
    for key, rule in RULES.items():
        assert set(rule) == set(ROLES), f"{key}: a rule needs an outcome for each of {ROLES}"


# --- A small world for the URL arguments ----------------------------------------------------------------


@pytest.fixture
def world(tmp_path):
    """Users in each role, a local and an SSH node with devices, a credential, a model with a confirmed
    deployment, a job, a stale process and an audit entry."""
    users = {role: UserFactory(username=f"matrix-{role}", role=role) for role in ROLES[1:]}
    now = timezone.now()
    credential = CredentialFactory(name="matrix-key", kind=CredentialKind.PASSWORD)
    desk = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True,
                       last_seen_at=now, reachability=Reachability.REACHABLE)  # fmt: skip
    DeviceFactory(node=desk, name="CPU", kind=DeviceKind.CPU, total_bytes=2**30, free_bytes=2**30)
    attic = NodeFactory(
        name="attic",
        credential=credential,
        reachability=Reachability.HOST_KEY_PENDING,
        pending_host_key="ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIMn0pQx8c9vF0rT4bW2yZ6uJ1kLhGdEs3",
        pending_host_key_fingerprint="SHA256:3f9TqZ0bV7yXw2LrKc8sMn5pHjDgA1eU6iO4lRtYvQk",
    )
    path = write_tiny_llama(tmp_path / "tiny.gguf", TinyLlama())
    profile = gguf_profile.profile_path(path)
    model = ModelFile.objects.create(
        name="tiny", node=desk, path=str(path), size_bytes=profile["size_bytes"], profile=profile
    )
    client = Client()
    client.force_login(users["admin"])
    response = client.post(
        reverse("deployments:confirm", args=[model.pk]),
        {"ctx": "512", "parallel": "1", "cache_type": "f16", "clamp": "0.7", "name": "tiny for the matrix"},
    )
    assert response.status_code == 302, response.content.decode()[:2000]
    job = Job.objects.create(kind="command", node=desk, title="echo", state=JobState.RUNNING, started_at=now)
    job.append_lines([("out", "hello")])
    stale = StaleProcess.objects.create(node=attic, port=50052, pid=4242, program="ggml-rpc-server")
    history.record(users["admin"], "node.update", attic, changes={"notes": ["", "x"]})
    return {
        "users": users,
        "node": attic,
        "credential": credential,
        "model": model,
        "deployment": Deployment.objects.get(),
        "job": job,
        "stale": stale,
        "group": Group.objects.get(name="viewer"),
        "event": AuditEvent.objects.first(),
    }


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


def _pk_of(key: str, data: dict) -> int:
    if key.startswith("nodes:credential"):
        return data["credential"].pk
    if key.startswith("jobs:"):
        return data["job"].pk
    if key in ("deployments:plan", "deployments:confirm"):
        return data["model"].pk
    if key == "deployments:stale_reap":
        return data["stale"].pk
    if key.startswith("deployments:"):
        return data["deployment"].pk
    if key in ("users:edit", "users:unlock"):
        return data["users"]["viewer"].pk
    raise AssertionError(f"{key}: say in _pk_of which object its <pk> is")


def _admin_object_id(key: str, data: dict) -> str:
    if "auth_group" in key or "auth/group" in key:
        return str(data["group"].pk)
    if "auditevent" in key:
        return str(data["event"].pk)
    return str(data["users"]["admin"].pk)  # users, and axes' (empty) tables


def url_of(key: str, pattern: URLPattern, data: dict) -> str:
    names = set(pattern.pattern.regex.groupindex)
    if pattern.name is None:
        # Unnamed admin routes: fill the regex by hand.
        path = "/" + key.replace("(?P<url>.*)$", "nothing-here/")
        return path.replace("<path:object_id>", _admin_object_id(key, data))
    kwargs: dict[str, object] = {}
    for name in names:
        if name == "name":
            kwargs[name] = data["node"].name
        elif name == "pk":
            kwargs[name] = _pk_of(key, data)
        elif name in ("object_id", "id"):
            kwargs[name] = _admin_object_id(key, data)
        elif name == "app_label":
            kwargs[name] = "auth"
        elif name == "content_type_id":
            kwargs[name] = ContentType.objects.get_for_model(data["users"]["admin"]).pk
        else:
            raise AssertionError(f"{key}: no way yet to fill <{name}> in tests/test_security_roles.py")
    return reverse(key, kwargs=kwargs)


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


# --- Websockets -------------------------------------------------------------------------------------------


def _session_cookie(user) -> str:
    client = Client()
    client.force_login(user)
    return client.cookies[settings.SESSION_COOKIE_NAME].value


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("route", WS_ROUTES)
async def test_websocket_route_answers_each_role_as_the_rules_say(route, tmp_path):
    assert route in RULES, f"Websocket route {route} has no rule in RULES (tests/test_security_roles.py)"
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
