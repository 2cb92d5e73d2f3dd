"""The docker compose trial, really run: the real docker-compose.yml (base images swapped for local
stand-ins by tests/compose/override.yml, because no registry is reachable here) is built and started; an
admin logs in with the password the web service printed, approves a demo node's host key after comparing
it with the node's own, and the real Celery worker in its container probes the node. Then `down -v` must
leave no container, volume or network of the project behind.
"""

from __future__ import annotations

import html
import os
import re
import time

import httpx
import pytest

from ramdeck_site.services import free_port
from tests.compose import stack as compose
from tests.unavailable import unavailable

pytestmark = [pytest.mark.compose, pytest.mark.timeout(3600)]

NODE, OTHER_NODE = "demo-node-1", "demo-node-2"
GIB = 1024**3


@pytest.fixture(scope="module")
def built_images() -> None:
    """Stand-in base images when missing, then the project's images (layers cached after the first run)."""
    reason = compose.unavailable_reason()
    if reason:
        unavailable(f"compose trial unavailable: {reason}")
    compose.cleanup_crashed_projects()
    started = time.monotonic()
    compose.build_standin_images()
    standins = time.monotonic() - started
    compose.ComposeStack(f"{compose.PROJECT_PREFIX}{os.getpid()}", 0).build()
    project = time.monotonic() - started - standins
    print(f"[compose] stand-in images {standins:.0f} s, project images {project:.0f} s")


def _login(client: httpx.Client, password: str) -> None:
    page = client.get("/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    response = client.post(
        "/login/", data={"username": "admin", "password": password, "csrfmiddlewaretoken": token}
    )
    assert response.status_code == 200 and 'action="/logout/"' in response.text, response.text[-2000:]


def _post_form(client: httpx.Client, path: str, data: dict[str, str]) -> httpx.Response:
    return client.post(path, data={**data, "csrfmiddlewaretoken": client.cookies["csrftoken"]})


def _node_state(stack: compose.ComposeStack, name: str) -> dict:
    return stack.console_query(
        "import json; from nodes.models import Node; from jobs.models import Job; "
        f"n = Node.objects.get(name={name!r}); "
        "print(json.dumps({'reachability': n.reachability, 'pending': n.pending_host_key_fingerprint, "
        "'approved': n.host_key_fingerprint, 'facts': n.facts, 'error': n.last_error, "
        "'devices': [(d.name, d.kind, d.total_bytes, d.free_bytes) for d in n.devices.all()], "
        "'jobs': [(j.kind, j.state, j.result) for j in Job.objects.filter(node=n).order_by('pk')]}))"
    )


def _wait_for_probe(stack: compose.ComposeStack, name: str, timeout: float = 180) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = _node_state(stack, name)
        statuses = [status for kind, status, _ in state["jobs"] if kind == "probe"]
        if statuses and statuses[-1] not in ("queued", "running"):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the probe of {name} did not finish in {timeout:g} s: {state}\n"
                + stack.logs("control")[-4000:]
            )
        time.sleep(2)


def _meminfo_total_bytes(stack: compose.ComposeStack, service: str) -> int:
    meminfo = stack.exec(service, "cat", "/proc/meminfo")
    return int(re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024


def test_compose_trial_serves_the_console_and_probes_an_approved_demo_node_then_leaves_nothing(
    built_images, figure
):
    stack = compose.ComposeStack(f"{compose.PROJECT_PREFIX}{os.getpid()}", free_port())
    try:
        started = time.monotonic()
        stack.up()
        served_after = stack.wait_until_served() + (time.monotonic() - started)
        print(f"[compose] up to a served login page: {served_after:.1f} s")
        figure("compose_up_to_login_page_s", round(served_after, 1))

        # The published port is on loopback only, and the admin password was generated and printed once.
        assert f"127.0.0.1:{stack.port}" in stack.compose("port", "web", "8000").stdout
        first_log = stack.logs("web")
        password = re.search(r"Created admin account 'admin' with password: (\S+)", first_log).group(1)
        assert "change-me-now" not in first_log

        with httpx.Client(base_url=stack.base_url, follow_redirects=True, timeout=30) as client:
            _login(client, password)

            # Both demo nodes are registered, their host keys pending; the demo model is registered.
            nodes_page = client.get("/nodes/").text
            assert NODE in nodes_page and OTHER_NODE in nodes_page
            assert "tiny-llama-demo" in client.get("/models/").text
            node_page = client.get(f"/nodes/{NODE}/").text
            offered = html.unescape(re.search(r'name="fingerprint" value="([^"]+)"', node_page).group(1))
            own_key = stack.exec(NODE, "ssh-keygen", "-lf", "/etc/ssh/ssh_host_ed25519_key.pub")
            assert offered == own_key.split()[1], "the pending key must be the one the node itself holds"
            assert (
                _node_state(stack, OTHER_NODE)["pending"]
                == stack.exec(OTHER_NODE, "ssh-keygen", "-lf", "/etc/ssh/ssh_host_ed25519_key.pub").split()[1]
            )

            # Approving starts a probe, which the control worker (its own container) runs over SSH.
            _post_form(client, f"/nodes/{NODE}/host-key/approve/", {"fingerprint": offered})
            state = _wait_for_probe(stack, NODE)
            assert state["approved"] == offered and not state["pending"]
            assert state["jobs"][-1][:2] == ["probe", "succeeded"], state
            assert state["reachability"] == "reachable", state

            # The hardware is what the container gets: its memory and its cores.
            [(device, kind, total, free)] = state["devices"]
            assert (device, kind) == ("CPU", "cpu")
            assert total == _meminfo_total_bytes(stack, NODE)
            assert 0 < free <= total
            assert state["facts"]["cpu_cores"] == int(stack.exec(NODE, "nproc").strip())
            assert client.get(f"/nodes/{NODE}/").text.count("Reachable") >= 1

            # Nothing ran on the node whose key nobody approved.
            other = _node_state(stack, OTHER_NODE)
            assert other["reachability"] == "host_key_pending" and not other["devices"] and not other["jobs"]

        # Redis keeps its data across a restart (append-only file in its volume): queued jobs survive.
        stack.exec("redis", "redis-cli", "SET", "ramdeck-compose-test", "kept")
        stack.compose("restart", "redis", timeout=120)
        kept = _eventually(lambda: stack.exec("redis", "redis-cli", "GET", "ramdeck-compose-test"))
        assert kept.strip() == "kept"

        # A restart of the console seeds nothing twice and keeps the approval and the password.
        stack.compose("restart", "web", timeout=120)
        stack.wait_until_served()
        web_log = stack.logs("web")
        assert web_log.count("Created admin account") == 1
        assert f"{NODE}: host key {offered} is approved." in web_log
        counts = stack.console_query(
            "import json; from nodes.models import Node, Credential; "
            "from deployments.models import ModelFile; print(json.dumps("
            "[Node.objects.count(), Credential.objects.count(), ModelFile.objects.count()]))"
        )
        assert counts == [2, 1, 1]
        with httpx.Client(base_url=stack.base_url, follow_redirects=True, timeout=30) as client:
            _login(client, password)
    finally:
        existed = stack.leftovers()
        down = stack.down()
    assert down.returncode == 0, down.stdout + down.stderr
    # The label lookup finds the project's things while they exist (so its empty answer below means gone):
    # web, worker, control, beat, postgres, redis and the two demo nodes.
    assert len(existed["container"]) == 8 and len(existed["volume"]) == 8 and existed["network"], existed
    assert stack.leftovers() == {"container": [], "volume": [], "network": []}


def _eventually(read, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return read()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
