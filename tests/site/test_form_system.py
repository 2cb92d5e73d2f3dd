"""One form system (issue 12): every bad value is a form error that names the problem, re-rendered with
nothing created, before any job starts; the builds and node forms show only the fields that apply.

The checks on a node run for real: a Local node (the console's own host, for an admin) with real folders,
real git repositories and real GGUF files under tmp_path.
"""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path

import pytest
from django.urls import reverse

from audit.models import AuditEvent
from jobs.models import Job
from llamacpp.args import model_alias
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile, name_from_path
from nodes.models import Node, Transport
from tests.factories import CredentialFactory, NodeFactory
from tests.paths import ROOT

pytestmark = pytest.mark.django_db


@pytest.fixture
def local_node(db):
    return NodeFactory(name="desk", address="127.0.0.1", transport=Transport.LOCAL, may_coordinate=True)


@pytest.fixture
def no_worker(monkeypatch):
    started = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: started.append(job.pk))
    return started


def start_build(client, node, **data):
    return client.post(reverse("builds:start", args=[node.name]), {"backend": "auto", **data})


def errors_of(response) -> str:
    """The text of the page's error lists (what the person reads beside the fields)."""
    page = response.content.decode()
    return " ".join(re.findall(r'<ul class="errorlist"[^>]*>(.*?)</ul>', page, re.S))


def assert_refused(response, message: str) -> None:
    assert response.status_code == 400, response.status_code
    assert message in errors_of(response), errors_of(response)
    assert "no build was started" in response.content.decode()
    assert not Job.objects.exists()
    assert not AuditEvent.objects.filter(action="build.requested").exists()


def executable(path: Path) -> Path:
    path.write_text("#!/bin/sh\necho not really\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def repo(tmp_path) -> Path:
    """A real git repository with a tag b9999."""
    repo = tmp_path / "llama.cpp.git"
    repo.mkdir()
    (repo / "CMakeLists.txt").write_text("project(mini)\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.test"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "mini"], check=True)
    subprocess.run([*git, "tag", "b9999"], check=True)
    return repo


# --------------------------------------------------------------------------------------------------
# The builds form


def test_the_builds_form_has_the_house_layout_and_one_block_per_source(operator_client):
    node = NodeFactory(name="old-pc")
    page = operator_client.get(reverse("builds:node", args=[node.name])).content.decode()
    assert 'id="build-form"' in page and 'class="stacked"' in page and "css/forms.css" in page
    # The source is a radio choice; each source's fields sit in the block that CSS shows for it.
    assert page.count('type="radio" name="source"') == 3
    for block, field in (("when-tarball", "tarball"), ("when-git", "git_url"), ("when-existing", "path")):
        start = page.index(f'class="{block}"') if f'class="{block}"' in page else page.index(f"{block}")
        assert f'name="{field}"' in page[start : start + 3000]
    assert 'id="field-git_url"' in page and 'id="field-path"' in page  # includes/field.html
    assert "<script>" not in page and "onclick" not in page


def test_the_stylesheet_shows_only_the_chosen_sources_fields():
    css = (ROOT / "static" / "css" / "forms.css").read_text()
    for source in ("tarball", "git", "existing"):
        assert f'#build-form:not(:has(input[name="source"][value="{source}"]:checked)) .when-{source}' in css
    assert '#node-form:has(select[name="transport"] option[value="local"]:checked) .when-ssh' in css
    assert '#credential-form:has(select[name="kind"] option[value="password"]:checked) .when-key' in css


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("not a url", "This is not a git URL"),
        ("notaurl", "This is not a git URL"),
        ("ftp://example.test/llama.cpp.git", "git URLs here start with https://"),
        ("https://", "This URL names no host"),
        ("https://github.com/", "This URL names no repository"),
        ("ext::sh -c touch% /tmp/x", "This is not a git URL"),
    ],
)
def test_a_malformed_git_url_is_a_form_error_and_no_job(operator_client, no_worker, url, message):
    node = NodeFactory(name="old-pc")
    response = start_build(operator_client, node, source="git", git_url=url, git_ref="b6800")
    assert_refused(response, message)
    assert f'value="{url}"' in response.content.decode().replace("&amp;", "&")  # kept, ready to correct
    assert no_worker == []


def test_a_malformed_git_ref_is_a_form_error(operator_client):
    node = NodeFactory(name="old-pc")
    response = start_build(
        operator_client, node, source="git", git_url="https://example.test/l.git", git_ref="a..b"
    )
    assert_refused(response, "A git ref (branch, tag or commit)")


def test_a_git_url_the_node_cannot_read_is_a_form_error(admin_client, local_node, tmp_path):
    response = start_build(
        admin_client, local_node, source="git", git_url=str(tmp_path / "no-such-repo"), git_ref="b9999"
    )
    assert_refused(response, f"desk could not read the repository at {tmp_path / 'no-such-repo'}:")
    assert "flock" not in errors_of(response) and "status 128" not in errors_of(response)


def test_a_git_ref_the_repository_lacks_is_a_form_error(admin_client, local_node, repo):
    response = start_build(admin_client, local_node, source="git", git_url=str(repo), git_ref="b1")
    assert_refused(response, f"The repository at {repo} has no branch or tag named b1.")


def test_a_readable_git_url_and_ref_start_the_build(admin_client, local_node, repo, no_worker):
    response = start_build(admin_client, local_node, source="git", git_url=str(repo), git_ref="b9999")
    job = Job.objects.get(kind="build")
    assert response.status_code == 302 and response.url == job.get_absolute_url()
    assert (job.params["git_url"], job.params["git_ref"]) == (str(repo), "b9999")


def test_an_existing_install_path_is_checked_on_the_node_before_any_job(admin_client, local_node, tmp_path):
    assert_refused(
        start_build(admin_client, local_node, source="existing", path="opt/llama"), "Give an absolute path"
    )
    missing = tmp_path / "nowhere"
    assert_refused(
        start_build(admin_client, local_node, source="existing", path=str(missing)),
        f"There is no folder {missing} on desk.",
    )
    folder = tmp_path / "bin"
    folder.mkdir()
    assert_refused(
        start_build(admin_client, local_node, source="existing", path=str(folder)),
        f"{folder} on desk holds no llama-server",
    )
    executable(folder / "llama-server")
    assert_refused(
        start_build(admin_client, local_node, source="existing", path=str(folder)),
        "holds llama-server but no ggml-rpc-server",
    )


def test_a_folder_with_both_binaries_starts_the_registration_job(
    admin_client, local_node, tmp_path, no_worker, django_capture_on_commit_callbacks
):
    folder = tmp_path / "bin"
    folder.mkdir()
    executable(folder / "llama-server")
    executable(folder / "ggml-rpc-server")
    with django_capture_on_commit_callbacks(execute=True):
        response = start_build(admin_client, local_node, source="existing", path=f"{folder}/")
    job = Job.objects.get(kind="build")
    assert response.status_code == 302 and job.params["path"] == str(folder)
    assert no_worker == [job.pk]


def test_an_unreachable_node_is_a_form_error_not_a_job(operator_client, settings):
    # Nothing listens on this loopback port: the check says so on the form.
    node = NodeFactory(name="gone", address="127.0.0.1", ssh_port=9, credential=CredentialFactory())
    response = start_build(operator_client, node, source="existing", path="/opt/llama")
    assert response.status_code == 400
    assert "Could not check this on gone" in errors_of(response)
    assert not Job.objects.exists()


# --------------------------------------------------------------------------------------------------
# Register by path


@pytest.fixture
def model_dir(tmp_path, settings) -> Path:
    settings.RAMDECK_MODEL_DIRS = [str(tmp_path)]
    return tmp_path


def register(client, node, path, name=""):
    return client.post(reverse("modelfiles:register"), {"name": name, "node": node.pk, "path": str(path)})


def test_an_empty_name_is_taken_from_the_file_name_not_the_headers_general_name(
    admin_client, local_node, model_dir
):
    path = write_tiny_llama(model_dir / "SmolLM2-135M-Instruct.Q4_1.gguf", TinyLlama())
    response = register(admin_client, local_node, path)
    assert response.status_code == 302, errors_of(response)
    model = ModelFile.objects.get()
    assert model.name == "SmolLM2-135M-Instruct.Q4_1"
    assert model.profile["name"] == "ramdeck tiny llama"  # the header's label stays in the profile
    # The model's API id (llama-server's --alias) is that name.
    assert model_alias(model.name) == "SmolLM2-135M-Instruct.Q4_1"


def test_a_name_from_the_file_that_is_taken_is_a_form_error(admin_client, local_node, model_dir):
    path = write_tiny_llama(model_dir / "tiny.gguf", TinyLlama())
    assert register(admin_client, local_node, path, name="tiny").status_code == 302
    other = model_dir / "other"
    other.mkdir()
    twin = write_tiny_llama(other / "tiny.gguf", TinyLlama(seed=7))
    response = register(admin_client, local_node, twin)
    assert response.status_code == 400
    assert "The file&#x27;s name gives tiny, and a model with this name is already registered" in errors_of(
        response
    )
    assert ModelFile.objects.count() == 1
    # A typed name wins over the file's.
    assert register(admin_client, local_node, twin, name="other").status_code == 302


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1"),
        ("/models/Qwen2.5-72B-Instruct-Q4_K_M-00001-of-00003.gguf", "Qwen2.5-72B-Instruct-Q4_K_M"),
        ("/models/model.GGUF", "model"),
        ("/models/no-extension", "no-extension"),
        ("/models/.gguf", ".gguf"),
    ],
)
def test_a_models_default_name_is_its_file_name_without_gguf_or_shard_suffix(path, name):
    assert name_from_path(path) == name


def test_a_file_that_is_not_gguf_is_refused_in_plain_words(admin_client, local_node, model_dir):
    notes = model_dir / "notes.gguf"
    notes.write_text("shopping list")
    elf = model_dir / "elf.gguf"
    elf.write_bytes(b"\x7fELF" + bytes(64))
    for path, said in ((notes, "“shop”"), (elf, "the bytes 7f 45 4c 46")):
        response = register(admin_client, local_node, path, name="m")
        errors = errors_of(response)
        assert response.status_code == 400 and f"This is not a GGUF file: it begins with {said}" in errors
        assert "b&#x27;" not in errors and "b'" not in errors
    missing = model_dir / "absent.gguf"
    response = register(admin_client, local_node, missing, name="m")
    assert response.status_code == 400 and "absent.gguf" in errors_of(response)
    assert not ModelFile.objects.exists()


# --------------------------------------------------------------------------------------------------
# The node form


def test_the_node_form_puts_ssh_fields_in_the_block_hidden_for_a_local_node(admin_client):
    page = admin_client.get(reverse("nodes:create")).content.decode()
    block = page[page.index('class="fieldset-row when-ssh"') :]
    block = block[: block.index("</div>\n    <div")]
    for field in ("address", "ssh_user", "ssh_port", "credential"):
        assert f'name="{field}"' in block, field
    assert "css/forms.css" in page


def test_a_local_node_needs_no_address_or_ssh_fields(admin_client):
    response = admin_client.post(
        reverse("nodes:create"),
        {
            "name": "console",
            "transport": "local",
            "rpc_port": 50052,
            "platform_hint": "auto",
            "enabled": "on",
        },
    )
    assert response.status_code == 302
    node = Node.objects.get(name="console")
    assert node.is_local and node.address == "127.0.0.1" and node.ssh_port == 22


def test_an_ssh_node_still_needs_its_address_and_port(admin_client):
    credential = CredentialFactory()
    response = admin_client.post(
        reverse("nodes:create"),
        {"name": "pc", "transport": "ssh", "ssh_user": "me", "credential": credential.pk, "rpc_port": 50052,
         "platform_hint": "auto", "address": "", "ssh_port": ""},
    )  # fmt: skip
    assert response.status_code == 200
    page = response.content.decode()
    assert "An SSH node needs its address" in page and "An SSH node needs the port" in page
    assert not Node.objects.exists()


def test_a_bad_node_name_is_explained_without_the_word_slug(admin_client):
    response = admin_client.post(
        reverse("nodes:create"),
        {"name": "my box", "transport": "local", "rpc_port": 50052, "platform_hint": "auto"},
    )
    errors = errors_of(response)
    assert "A node name has letters, digits" in errors and "slug" not in errors.lower()
    assert not Node.objects.exists()


# --------------------------------------------------------------------------------------------------
# The same checks on a remote node, over its SSH transport (a lab host's real sshd)


@pytest.mark.lab
@pytest.mark.timeout(180)
def test_a_remote_nodes_install_folder_and_git_url_are_checked_over_ssh(
    lab, lab_host, operator_client, tmp_path, repo, no_worker, settings
):
    from tests.deploy_fixtures import lab_node

    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 3.0
    node = lab_node(lab, lab_host)
    folder = tmp_path / "bin"
    folder.mkdir()
    executable(folder / "llama-server")
    assert_refused(
        start_build(operator_client, node, source="existing", path=str(folder)),
        "holds llama-server but no ggml-rpc-server",
    )
    assert_refused(
        start_build(operator_client, node, source="git", git_url=str(repo), git_ref="no-such-tag"),
        "has no branch or tag named no-such-tag",
    )
    executable(folder / "ggml-rpc-server")
    response = start_build(operator_client, node, source="existing", path=str(folder))
    assert response.status_code == 302, errors_of(response)
    assert Job.objects.get(kind="build").params["path"] == str(folder)
