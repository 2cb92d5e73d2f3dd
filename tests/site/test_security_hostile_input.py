"""Hostile values (quotes, `$(...)`, backticks, `;`, newlines, NUL, unicode, very long strings) through every
field that reaches a command on a node, against a lab host (real sshd in a network namespace): the form
refuses the value with a message on that field, or the node receives exactly the argument vector the
console meant. The program on the node is a Python one-liner that prints its own argv as JSON, put in front
of the argument vector the console builds, so what arrives is compared element by element.

The chain is proved in two links: each form → the argument vector the job builds from the cleaned value
(the same builder functions the jobs call), and any argument vector → the node, through the SSH
transport's `run` and its detached `start_daemon` (the shell text both produce is the only place quoting
happens: remote/base.py's `shell_join`).

Deployment names and node names never reach a command line (node names are slugs; log file names use them),
and llama-server / rpc-server take no free-form extra arguments from any form.
"""

from __future__ import annotations

import asyncio
import json
import posixpath
import shlex

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builds.forms import BuildForm
from llamacpp.args import rpc_server_args
from modelfiles.download import curl_argv
from modelfiles.forms import ModelDownloadForm, ModelRegisterForm
from nodes.forms import NodeForm
from nodes.models import CredentialKind, Transport
from nodes.views.commands import CommandForm
from remote.base import Command
from remote.ssh import SSHTarget, SSHTransport
from tests.downloads import curl_reads_back
from tests.factories import CredentialFactory, NodeFactory

pytestmark = [pytest.mark.security, pytest.mark.lab, pytest.mark.timeout(300)]

# The program in front of every argument vector: it prints the argv it was given, as one JSON line.
ECHO = ["python3", "-c", "import json, sys; print(json.dumps(sys.argv[1:]))"]

PIECES = [
    "'", '"', "\\", "$(touch /tmp/ramdeck-pwned)", "`touch /tmp/ramdeck-pwned`", ";", "&&", "|", ">", "<",
    "\n", "\r", "\t", " ", "\x00", "$HOME", "${IFS}", "*", "?", "~", "#", "!", "-", "--", "-rf", "%s",
    "é", "ß", "🦙", "\u202e", "\u00a0", "日本語", "a", "x.gguf", "/", "..", "http://", ":",
]  # fmt: skip
HOSTILE = st.one_of(
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=12).map("".join),
    st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=40),
    st.sampled_from(PIECES),
    st.integers(min_value=1000, max_value=3000).map(lambda n: "$(id)'\"`;" * (n // 8)),  # very long
)
EXAMPLES = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@pytest.fixture
def node_shell(lab, lab_host, tmp_path):
    """`deliver(argv)`: what argv becomes on the lab host (the echo program's view), `daemon(argv)` the
    same through a detached start, `read_head(path)` the first bytes of a file read over SFTP."""
    loop = asyncio.new_event_loop()
    target = SSHTarget(
        host=lab_host.address,
        private_key=lab.client_private_key,
        pinned_host_key=lab_host.host_public_key,
        connect_timeout=5.0,
        command_timeout=60.0,
    )
    ssh = SSHTransport(target)
    loop.run_until_complete(ssh.__aenter__())

    def deliver(argv: list[str]) -> list[str]:
        result = loop.run_until_complete(ssh.run([*ECHO, *argv], timeout=60, check=True))
        return json.loads(result.stdout)

    def daemon(argv: list[str]) -> list[str]:
        log = str(tmp_path / f"daemon-{len(list(tmp_path.iterdir()))}.log")

        async def start_and_read() -> str:
            pid = await ssh.start_daemon([*ECHO, *argv], log_path=log)
            for _ in range(200):
                if not await ssh.pid_alive(pid):
                    break
                await asyncio.sleep(0.05)
            return (await ssh.run(["cat", log], check=True)).stdout

        return json.loads(loop.run_until_complete(start_and_read()))

    def read_head(path: str) -> bytes:
        return loop.run_until_complete(ssh.read_head(path, 64))

    yield type("NodeShell", (), {"deliver": staticmethod(deliver), "daemon": staticmethod(daemon),
                                 "read_head": staticmethod(read_head)})  # fmt: skip
    loop.run_until_complete(ssh.__aexit__(None, None, None))
    loop.close()


def refused_with_message(form, field: str) -> bool:
    """The form is invalid and says why, on the field (or the form as a whole)."""
    errors = form.errors.get(field) or form.errors.get("__all__") or []
    return not form.is_valid() and all(str(e).strip() for e in errors) and bool(errors)


# --- Any argument vector reaches the node exactly ----------------------------------------------------------


@given(argv=st.lists(HOSTILE, min_size=1, max_size=6))
@EXAMPLES
def test_any_argument_vector_reaches_the_node_exactly_or_is_refused(node_shell, argv):
    if any("\x00" in arg for arg in argv):
        # No command line can carry a NUL: refused before anything runs, saying so.
        with pytest.raises(ValueError, match="NUL"):
            Command(argv, lambda command: None)
        return
    assert node_shell.deliver(argv) == argv


@given(argv=st.lists(HOSTILE.filter(lambda a: "\x00" not in a), min_size=1, max_size=4))
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_a_detached_process_gets_its_argument_vector_exactly(node_shell, argv):
    assert node_shell.daemon(argv) == argv


# --- Each form field that reaches a command -----------------------------------------------------------------


@pytest.fixture
def forms_world(db):
    credential = CredentialFactory(name="hostile-key", kind=CredentialKind.PASSWORD)
    node = NodeFactory(name="worker", address="192.0.2.10", credential=credential)
    return {"credential": credential, "node": node}


def node_form(world, **overrides) -> NodeForm:
    data = {
        "name": "fresh-node",
        "address": "192.0.2.20",
        "transport": Transport.SSH,
        "ssh_port": "22",
        "ssh_user": "root",
        "credential": str(world["credential"].pk),
        "rpc_port": "50052",
        "rpc_bind_address": "",
        "platform_hint": "auto",
        "notes": "",
        "enabled": "on",
    }
    return NodeForm(data={**data, **overrides})


def test_the_baseline_forms_are_valid(forms_world):
    """The hostile tests below change one field at a time of these forms; unchanged, each is valid."""
    assert node_form(forms_world).is_valid(), node_form(forms_world).errors
    download = ModelDownloadForm(data={"url": "https://example.test/m.gguf", "node": forms_world["node"].pk,
                                       "dest": "/models/m.gguf"})  # fmt: skip
    assert download.is_valid(), download.errors
    build = BuildForm(data={"source": "git", "git_url": "https://example.test/l.git", "git_ref": "b1",
                            "backend": "cpu"})  # fmt: skip
    assert build.is_valid(), build.errors


@given(value=HOSTILE)
@EXAMPLES
def test_node_address_and_rpc_bind_address(forms_world, node_shell, value):
    for field in ("address", "rpc_bind_address"):
        form = node_form(forms_world, **{field: value})
        if not form.is_valid():
            assert refused_with_message(form, field), (field, value, form.errors)
            continue
        host = form.cleaned_data[field]
        # The worker's rpc-server binds it; the coordinator's llama-server names it in --rpc.
        argv = ["ggml-rpc-server", *rpc_server_args(host, 50052, ["CPU"])]
        assert node_shell.deliver(argv) == argv
        assert argv[2] == host
        coordinator = ["llama-server", "-m", "/models/m.gguf", "--rpc", f"{host}:50052"]
        assert node_shell.deliver(coordinator) == coordinator


@given(value=HOSTILE)
@EXAMPLES
def test_ssh_user_is_a_plain_login_name_or_refused(forms_world, value):
    """The SSH user goes into the SSH protocol, never into a shell; still, only login names pass, so it
    can never become an option (`-oProxyCommand=...`) or shell text anywhere later."""
    form = node_form(forms_world, ssh_user=value)
    if form.is_valid():
        user = form.cleaned_data["ssh_user"]
        assert user == shlex.quote(user) and not user.startswith("-"), user
    else:
        assert refused_with_message(form, "ssh_user"), (value, form.errors)


@given(url_tail=HOSTILE, dest=HOSTILE)
@EXAMPLES
def test_download_url_and_destination(forms_world, node_shell, url_tail, dest):
    for url in (url_tail, f"https://example.test/{url_tail}"):
        form = ModelDownloadForm(data={"url": url, "node": forms_world["node"].pk, "dest": f"/models/{dest}"})
        if not form.is_valid():
            assert form.errors and all(str(e).strip() for errs in form.errors.values() for e in errs)
            continue
        params = form.params()
        argv = curl_argv(params["dest"] + ".part")
        assert node_shell.deliver(argv) == argv
        assert argv[argv.index("--output") + 1] == params["dest"] + ".part"
        # The URL reaches curl on its standard input, as one quoted config line, never in its argv.
        real = form.cleaned_data["url"]
        assert real not in argv and argv[-2:] == ["--config", "-"]
        if url.startswith("https://example.test/"):
            assert curl_reads_back(real) == real


@given(git_url=HOSTILE, git_ref=HOSTILE)
@EXAMPLES
def test_build_git_url_and_ref(forms_world, node_shell, git_url, git_ref):
    form = BuildForm(data={"source": "git", "git_url": git_url, "git_ref": git_ref, "backend": "cpu"})
    if not form.is_valid():
        assert refused_with_message(form, "git_url") or refused_with_message(form, "git_ref"), form.errors
        return
    params = form.params()
    tree = "/root/.ramdeck/git/llama.cpp"
    # builds/job.py's _git_tree: the URL and the ref always after `--`.
    for argv in (
        ["git", "clone", "--", params["git_url"], tree],
        ["git", "-C", tree, "fetch", "--tags", "--", params["git_url"], params["git_ref"]],
    ):
        assert node_shell.deliver(argv) == argv


@given(path=HOSTILE)
@EXAMPLES
def test_build_from_an_existing_install_path(forms_world, node_shell, path):
    form = BuildForm(data={"source": "existing", "path": path, "backend": "cpu"})
    if not form.is_valid():
        assert refused_with_message(form, "path"), form.errors
        return
    folder = form.params()["path"]
    argv = [posixpath.join(folder, "llama-server"), "--version"]  # build_job.probe_binaries
    assert node_shell.deliver(argv) == argv


@given(name=HOSTILE)
@EXAMPLES
def test_register_path_is_read_over_sftp_exactly(forms_world, node_shell, tmp_path_factory, name):
    """register-by-path reads the header over SFTP (no shell at all): the file read is the file named."""
    folder = tmp_path_factory.mktemp("models")
    path = f"{folder}/{name}"
    form = ModelRegisterForm(data={"name": "m", "node": forms_world["node"].pk, "path": path})
    if not form.is_valid():
        assert refused_with_message(form, "path"), form.errors
        return
    cleaned = form.cleaned_data["path"]  # the form trims surrounding whitespace, nothing else
    assert cleaned == path.strip()
    # Deploying it: llama-server -m PATH on the coordinator (deployments/steps/llama_server.py).
    argv = ["llama-server", "-m", cleaned, "--port", "8080"]
    assert node_shell.deliver(argv) == argv
    name = cleaned.removeprefix(f"{folder}/")
    if not name or "/" in name or name in (".", "..") or len(name.encode()) > 255:
        return  # not a file name of its own in that folder; nothing to create for the comparison
    (folder / name).write_bytes(b"GGUF" + name.encode()[:60])
    assert node_shell.read_head(cleaned) == (b"GGUF" + name.encode()[:60])


@given(line=HOSTILE)
@EXAMPLES
def test_command_line_of_a_command_job(forms_world, node_shell, line):
    form = CommandForm(data={"node": forms_world["node"].name, "command": line}, user=None)
    if not form.is_valid():
        assert refused_with_message(form, "command"), form.errors
        return
    argv = form.cleaned_data["command"]
    assert argv == shlex.split(line)
    assert node_shell.deliver(argv) == argv
