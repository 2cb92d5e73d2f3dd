"""Where a deployment's llama-server listens: the choice made with the plan, at confirm time.

The endpoint is what people (and chat front ends such as Open WebUI) connect to with the deployment's API
key, and what the console itself reaches to verify, measure and chat. So:

- a coordinator that is not the console's host listens on its own address by default (the console and the
  rest of the LAN reach it there); loopback is not offered for it, since nothing but that machine could
  connect, the console included;
- the console's own host listens on loopback by default (only programs on this machine, the console's chat
  included), or, chosen here, on its network address or every interface.

The choice is stored as `Deployment.host` / `Deployment.port`, and llama-server's `--host` / `--port`
follow it (deployments/steps/llama_server.py).
"""

from __future__ import annotations

import json
import os

from django import forms

from deployments.models import ResourceClaim
from jobs.aio import run_to_completion
from llamacpp.reaper import find_holders
from nodes.models import Node
from nodes.transports import transport_for
from remote.base import TransportError, shell_join

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
ALL_INTERFACES = "0.0.0.0"
DEFAULT_PORT = 8080
# How far past DEFAULT_PORT the default looks for a port no active deployment holds on the coordinator.
PORT_SEARCH = 100

LOOPBACK, LAN, ALL = "loopback", "lan", "all"


def has_lan_address(node: Node) -> bool:
    return node.address not in LOOPBACK_HOSTS


def reach_choices(node: Node) -> list[tuple[str, str, str]]:
    """(value, label, explanation) of each place llama-server may listen on this coordinator."""
    choices = []
    if node.is_local:
        choices.append(
            (
                LOOPBACK,
                "This machine only (127.0.0.1)",
                "Programs on the console's host, the console's chat included. Other machines cannot connect.",
            )
        )
    if has_lan_address(node):
        where = "the console's host" if node.is_local else node.name
        choices.append(
            (
                LAN,
                f"Your network, at {node.address}",
                f"{where}'s address: other machines on your network (a phone, Open WebUI on another "
                "computer) connect with the API key"
                + ("." if node.is_local else "; so does the console, to check it and to chat."),
            )
        )
    choices.append(
        (
            ALL,
            f"Every interface of {'this machine' if node.is_local else node.name} ({ALL_INTERFACES})",
            "Reachable on every network it is on (VPNs and containers too), always with the API key."
            if has_lan_address(node)
            else "Your network: other machines reach it at this machine's LAN address, with the API key.",
        )
    )
    return choices


def default_reach(node: Node) -> str:
    """Reachable from the LAN when the coordinator is not the console's host; loopback when it is."""
    if node.is_local:
        return LOOPBACK
    return LAN if has_lan_address(node) else ALL


def host_for(node: Node, reach: str) -> str:
    if reach == LOOPBACK:
        return "127.0.0.1"
    if reach == LAN:
        return node.address
    return ALL_INTERFACES


def reach_of(node: Node, host: str) -> str:
    """The choice a stored host corresponds to (for showing it again)."""
    if host in LOOPBACK_HOSTS:
        return LOOPBACK
    if host in (ALL_INTERFACES, "::"):
        return ALL
    return LAN


def _ports_held(node: Node) -> dict[int, str]:
    """Ports of this node that active deployments claim: {port: the deployment holding it}."""

    held = {}
    claims = ResourceClaim.objects.active().filter(node=node, resource__startswith="port:")
    claims = claims.select_related("deployment")
    for claim in claims:
        held[int(claim.resource.split(":", 1)[1])] = str(claim.deployment)
    return held


def default_port(node: Node) -> int:
    """8080, or the next port that neither an active deployment nor the node's rpc-server uses."""
    held = _ports_held(node)
    for port in range(DEFAULT_PORT, DEFAULT_PORT + PORT_SEARCH):
        if port not in held and port != node.rpc_port:
            return port
    return DEFAULT_PORT


class EndpointForm(forms.Form):
    """The endpoint part of the plan page's confirm form. Absent values take the coordinator's defaults;
    values that are given and wrong are errors on the form, never replaced."""

    reach = forms.ChoiceField(
        label="Who can connect",
        required=False,
        widget=forms.RadioSelect,
        help_text="Which programs may talk to the model (with its API key): this machine's or the LAN's.",
    )
    port = forms.IntegerField(
        label="Port",
        required=False,
        min_value=1024,
        max_value=65535,
        help_text="llama-server's port on the coordinator (1024–65535).",
    )

    def __init__(self, *args, coordinator: Node, **kwargs):
        super().__init__(*args, **kwargs)
        self.coordinator = coordinator
        self.options = reach_choices(coordinator)
        self.fields["reach"].choices = [(value, label) for value, label, _ in self.options]
        self.fields["reach"].initial = default_reach(coordinator)
        self.fields["port"].initial = default_port(coordinator)

    def clean_reach(self) -> str:
        return self.cleaned_data.get("reach") or default_reach(self.coordinator)

    def clean_port(self) -> int:
        port = self.cleaned_data.get("port")
        if port is None:
            return default_port(self.coordinator)
        if port == self.coordinator.rpc_port:
            raise forms.ValidationError(
                f"Port {port} is {self.coordinator.name}'s ggml-rpc-server port; choose another."
            )
        holder = _ports_held(self.coordinator).get(port)
        if holder:
            raise forms.ValidationError(
                f"Port {port} on {self.coordinator.name} is held by deployment {holder}; choose another."
            )
        return port

    def host(self) -> str:
        return host_for(self.coordinator, self.cleaned_data["reach"])

    def rows(self) -> list[dict]:
        """The radio buttons with their explanations, for the template."""
        recommended = default_reach(self.coordinator)
        chosen = self["reach"].value() or recommended
        return [
            {
                "value": value,
                "label": label,
                "help": help_text,
                "checked": value == chosen,
                "recommended": value == recommended,
            }
            for value, label, help_text in self.options
        ]


# How long Confirm waits for the coordinator's listener table before it confirms without it.
PORT_CHECK_TIMEOUT_S = 20


def port_taken(node: Node, port: int, *, console_port: int | None = None) -> tuple[str, str]:
    """(error, warning) about llama-server's port on the coordinator, looked up in its listener table over
    its transport (llamacpp/reaper.py, as the reap step does): an error naming what holds the port when a
    program that is not ours listens there (the console's own web server included); a warning when the
    table could not be read (the node is offline, say), since Deploy's reap step looks again. A stale
    llama.cpp process of ours is no error: the reap step ends it."""
    try:
        transport = transport_for(node)

        async def look():
            async with transport as opened:
                return await find_holders(opened, node.platform, port)

        holders = run_to_completion(look)
    except (TransportError, OSError, TimeoutError) as exc:
        return (
            "",
            f"Could not check whether port {port} is free on {node.name} ({exc}); Deploy checks it again.",
        )
    foreign = [h for h in holders if not h.ours]
    if not foreign:
        return "", ""
    holder = foreign[0]
    if node.is_local and (holder.pid == os.getpid() or port == console_port):
        what = "the console's own web server"
    else:
        what = holder.describe()
    return f"Port {port} on {node.name} is in use by {what}; choose another.", ""


def endpoint_form(data, coordinator: Node) -> EndpointForm:
    """The form for the page: bound to what was sent, except a choice the (changed) coordinator does not
    offer, which starts again from its default, visibly selected."""
    if data is None or ("reach" not in data and "port" not in data):
        return EndpointForm(coordinator=coordinator)
    values = {"reach": data.get("reach", ""), "port": data.get("port", "")}
    if values["reach"] not in {value for value, _, _ in reach_choices(coordinator)}:
        values["reach"] = ""
    return EndpointForm(values, coordinator=coordinator)


def bind_host(deployment) -> str:
    """llama-server's --host. A loopback address on a remote coordinator could not be reached by the
    console (or anyone else), so it binds to the coordinator's own address instead."""
    host = deployment.host or "127.0.0.1"
    if host in ("127.0.0.1", "localhost", "::1") and not deployment.coordinator.is_local:
        return deployment.coordinator.address
    return host


def reach_host(deployment) -> str:
    """Where clients (and the console) reach llama-server: where it binds, or the coordinator's address
    when it binds to every interface."""
    host = bind_host(deployment)
    return deployment.coordinator.address if host in ("0.0.0.0", "::") else host


def endpoint_url(deployment) -> str:
    host = reach_host(deployment)
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{deployment.port}"


# -- What people paste to use the endpoint ------------------------------------------------------------------

# Where Open WebUI is opened in a browser. Its container listens on 8080 (its start script reads $PORT),
# which is llama-server's default port too.
OPENWEBUI_PORT = 3000
OPENWEBUI_IMAGE = "ghcr.io/open-webui/open-webui:main"
# The examples read the key from the environment, so it is not kept in a script or the shell's history.
KEY_VARIABLE = "RAMDECK_API_KEY"


def is_loopback(deployment) -> bool:
    return reach_host(deployment) in LOOPBACK_HOSTS


def openwebui_port(deployment) -> int:
    """Open WebUI's own port: 3000, or the next one when the deployment's llama-server has that."""
    return OPENWEBUI_PORT if deployment.port != OPENWEBUI_PORT else OPENWEBUI_PORT + 1


def openwebui_command(deployment) -> tuple[list[list[str]], str]:
    """`docker run` for Open WebUI talking to this endpoint, as the lines of the printed command (each an
    argument list), and the address to open it at.

    A loopback endpoint is reached only from the coordinator itself, so the container shares its network
    (`--network host`; Docker ignores `-p` then) and Open WebUI listens on a port of its own (`-e PORT=`),
    not on its default 8080, which llama-server may hold. Any other endpoint is reached from the container's
    own network, with Open WebUI's 8080 published as 3000."""
    own = openwebui_port(deployment)
    if is_loopback(deployment):
        network = ["--network", "host", "-e", f"PORT={own}"]
        open_at = f"http://127.0.0.1:{own}"
    else:
        network = ["-p", f"{own}:8080"]
        open_at = f"http://localhost:{own}"
    lines = [
        ["docker", "run", "-d", *network],
        ["-e", f"OPENAI_API_BASE_URL={endpoint_url(deployment)}/v1"],
        ["-v", "open-webui:/app/backend/data", "--name", "open-webui", OPENWEBUI_IMAGE],
    ]
    return lines, open_at


def openwebui_text(deployment) -> str:
    """The command as printed: one option group a line; the key comes from the shell's variable."""
    lines, _ = openwebui_command(deployment)
    text = [shell_join(line) for line in lines]
    text.insert(2, f'-e OPENAI_API_KEY="${KEY_VARIABLE}"')
    return " \\\n  ".join(text)


def snippets(deployment, alias: str) -> dict[str, str]:
    """The examples the API key page prints (and copies): plain text, shown escaped."""
    url = endpoint_url(deployment)
    body = json.dumps({"model": alias, "messages": [{"role": "user", "content": "Hello"}]})
    curl = " \\\n  ".join(
        [
            shell_join(["curl", f"{url}/v1/chat/completions"]),
            f'-H "Authorization: Bearer ${KEY_VARIABLE}"',  # double quotes: the shell puts the key in
            shell_join(["-H", "Content-Type: application/json"]),
            shell_join(["-d", body]),
        ]
    )
    python = "\n".join(
        [
            "# pip install openai",
            "import os",
            "",
            "from openai import OpenAI",
            "",
            f"client = OpenAI(base_url={json.dumps(url + '/v1')}, api_key=os.environ[{KEY_VARIABLE!r}])",
            "reply = client.chat.completions.create(",
            f'    model={json.dumps(alias)}, messages=[{{"role": "user", "content": "Hello"}}]',
            ")",
            "print(reply.choices[0].message.content)",
        ]
    )
    return {
        "curl": curl,
        "python": python,
        "openwebui_run": openwebui_text(deployment),
        "openwebui_open_at": openwebui_command(deployment)[1],
        "base_url": f"{url}/v1",
    }
