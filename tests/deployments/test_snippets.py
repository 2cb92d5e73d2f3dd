"""The API key page's examples work as printed for the deployment's endpoint: the Open WebUI `docker run`
line's URL and flags follow the endpoint's address (a loopback endpoint needs the host's network and a port
of Open WebUI's own), the curl and Python examples name the right URL and model, each has a Copy button."""

from __future__ import annotations

import html
import json
import re
import shlex

import pytest
from django.urls import reverse

from deployments.endpoint import endpoint_url
from deployments.models import Deployment
from modelfiles.models import ModelFile
from nodes.models import Transport
from tests.factories import NodeFactory

SNIPPETS = ("api-key", "curl-example", "python-example", "openwebui-env", "openwebui-run")


def make_deployment(admin_user, *, local: bool, host: str, port: int = 8080, name: str = "SmolLM2-135M"):
    if local:
        node = NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True)
    else:
        node = NodeFactory(name="pc", address="192.168.1.20", may_coordinate=True)
    model = ModelFile.objects.create(name=name, node=node, path="/m/smol.gguf")
    deployment = Deployment.objects.create(name="smol", model_file=model, coordinator=node,
                                           plan={"fits": True}, host=host, port=port,
                                           created_by=admin_user)  # fmt: skip
    deployment.set_api_key("sk-household-123")
    deployment.save()
    return deployment


def snippet(page: str, element_id: str) -> str:
    return html.unescape(re.search(rf'<pre class="mono" id="{element_id}">(.*?)</pre>', page, re.S).group(1))


def argv_of(text: str) -> list[str]:
    """The shell's words of a printed command (its lines joined at the backslashes)."""
    return shlex.split(text.replace("\\\n", " "))


def key_page(client, deployment) -> str:
    response = client.get(reverse("deployments:api_key", args=[deployment.pk]))
    assert response.status_code == 200
    return response.content.decode()


def env_of(argv: list[str]) -> dict[str, str]:
    return dict(argv[i + 1].split("=", 1) for i, word in enumerate(argv) if word == "-e")


def test_a_loopback_endpoint_runs_open_webui_on_the_hosts_network_on_a_port_of_its_own(
    admin_client, admin_user
):
    deployment = make_deployment(admin_user, local=True, host="127.0.0.1", port=8080)
    page = key_page(admin_client, deployment)
    argv = argv_of(snippet(page, "openwebui-run"))
    assert argv[:3] == ["docker", "run", "-d"] and argv[-1] == "ghcr.io/open-webui/open-webui:main"
    # Only the coordinator reaches 127.0.0.1:8080, so the container shares its network, where Open WebUI's
    # usual 8080 is llama-server's: it listens on 3000 instead (its start script reads PORT).
    assert argv[argv.index("--network") + 1] == "host" and "-p" not in argv
    env = env_of(argv)
    assert env["OPENAI_API_BASE_URL"] == "http://127.0.0.1:8080/v1" == endpoint_url(deployment) + "/v1"
    assert env["PORT"] == "3000" != str(deployment.port)
    assert env["OPENAI_API_KEY"] == "$RAMDECK_API_KEY"  # shlex does not expand: the shell will
    assert 'OPENAI_API_KEY="$RAMDECK_API_KEY"' in snippet(page, "openwebui-run")
    assert '<code id="openwebui-open-at">http://127.0.0.1:3000</code>' in page
    assert 'id="loopback-note"' in page and "--network host" in page


def test_open_webui_moves_aside_when_llama_server_holds_its_port(admin_client, admin_user):
    deployment = make_deployment(admin_user, local=True, host="127.0.0.1", port=3000)
    env = env_of(argv_of(snippet(key_page(admin_client, deployment), "openwebui-run")))
    assert env["PORT"] == "3001" and env["OPENAI_API_BASE_URL"] == "http://127.0.0.1:3000/v1"


@pytest.mark.parametrize("host", ["192.168.1.20", "0.0.0.0"])
def test_a_network_endpoint_runs_open_webui_on_its_own_network_with_the_coordinators_address(
    admin_client, admin_user, host
):
    deployment = make_deployment(admin_user, local=False, host=host, port=8081)
    page = key_page(admin_client, deployment)
    argv = argv_of(snippet(page, "openwebui-run"))
    assert "--network" not in argv and argv[argv.index("-p") + 1] == "3000:8080"
    env = env_of(argv)
    assert env["OPENAI_API_BASE_URL"] == "http://192.168.1.20:8081/v1" == endpoint_url(deployment) + "/v1"
    assert "PORT" not in env
    assert '<code id="openwebui-open-at">http://localhost:3000</code>' in page
    assert 'id="loopback-note"' not in page


def test_the_curl_and_python_examples_name_the_endpoint_and_the_model_whatever_its_name(
    admin_client, admin_user
):
    deployment = make_deployment(admin_user, local=True, host="127.0.0.1", name='Bob\'s model "v2"')
    page = key_page(admin_client, deployment)
    curl = argv_of(snippet(page, "curl-example"))
    assert curl[:2] == ["curl", "http://127.0.0.1:8080/v1/chat/completions"]
    assert curl[curl.index("-H") + 1] == "Authorization: Bearer $RAMDECK_API_KEY"
    assert json.loads(curl[curl.index("-d") + 1])["model"] == 'Bob\'s model "v2"'
    python = snippet(page, "python-example")
    compile(python, "example.py", "exec")  # it is Python
    assert 'base_url="http://127.0.0.1:8080/v1"' in python and 'model="Bob\'s model \\"v2\\""' in python
    assert "OPENAI_API_BASE_URL=http://127.0.0.1:8080/v1\nOPENAI_API_KEY=sk-household-123" in snippet(
        page, "openwebui-env"
    )


def test_every_snippet_and_the_key_has_a_copy_button(admin_client, admin_user):
    page = key_page(admin_client, make_deployment(admin_user, local=True, host="127.0.0.1"))
    for element_id in SNIPPETS:
        assert f'id="{element_id}"' in page
        assert f'data-copy="#{element_id}"' in page, element_id
    assert "<script" not in page.split("</head>")[1]  # the buttons work through static/js/ramdeck.js
