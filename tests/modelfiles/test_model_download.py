"""The download job end to end: a real HTTP server on loopback (with Range support, so resuming is real), the
operator's form, the real runner with curl on the console's own host (and on a lab host over SSH), the
SHA-256 check, and registration from the downloaded file's header."""

from __future__ import annotations

import html
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from django.urls import reverse

from audit.models import AuditEvent
from jobs import runner
from jobs.models import Job, JobState
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles.models import ModelFile
from ramdeck_site import crypto
from tests.deploy_fixtures import lab_node
from tests.downloads import RangeServer, download, log_text, post_download, run
from tests.job_fixtures import wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]


@pytest.fixture(autouse=True)
def private_channels(channel_layer):
    return channel_layer


@pytest.fixture(autouse=True)
def console_host_may_fetch_from_loopback(settings, tmp_path):
    """The test server listens on loopback, which the console's own host refuses unless an admin allows
    it; the files go into the test's folder, made the model folder (tests/modelfiles/test_download_safety.py
    checks both rules)."""
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.0/8"]
    settings.RAMDECK_MODEL_DIRS = [str(tmp_path)]


def fetches(server) -> list[tuple[str, str, str | None]]:
    """The server's GET requests without the one-byte probes that check each hop before the download."""
    return [r for r in server.requests if r[0] == "GET" and r[2] != "bytes=0-0"]


@pytest.fixture
def model_bytes(tmp_path_factory) -> bytes:
    return write_tiny_llama(tmp_path_factory.mktemp("served") / "tiny.gguf", TinyLlama()).read_bytes()


@pytest.fixture
def server(model_bytes) -> Iterator[RangeServer]:
    instance = RangeServer({"/models/tiny.gguf": model_bytes, "/notes.gguf": b"<html>Please log in</html>\n"})
    yield instance
    instance.close()


@pytest.fixture
def sent(monkeypatch) -> list[int]:
    """Job ids handed to Celery (none reaches a broker)."""
    ids: list[int] = []
    monkeypatch.setattr(Job, "send_to_worker", lambda job: ids.append(job.pk))
    return ids


def sha256_of(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


# --------------------------------------------------------------------------------------------------
# The form and the view
# --------------------------------------------------------------------------------------------------


def test_an_admin_downloads_a_model_onto_the_console_host_and_it_is_registered_with_its_hash(
    local_node,
    admin_client,
    admin_user,
    server,
    model_bytes,
    sent,
    tmp_path,
):
    dest = tmp_path / "models" / "tiny.gguf"
    url = server.url("/models/tiny.gguf")
    response = post_download(
        admin_client, url=url, node=local_node.pk, dest=str(dest), sha256=sha256_of(model_bytes).upper()
    )
    job = Job.objects.get(kind="download")
    assert response.status_code == 302 and response.url == job.get_absolute_url()
    assert sent == [job.pk]
    assert crypto.decrypt(job.params.pop("url_secret")) == url
    assert job.params == {
        "url": url,
        "dest": str(dest),
        "sha256": sha256_of(model_bytes),
        "name": "tiny",
    }
    assert job.created_by == admin_user and job.node == local_node
    event = AuditEvent.objects.get(action="model.download")
    assert event.actor_name == admin_user.username and event.changes["url"] == url

    job = run(job)
    assert job.state == JobState.SUCCEEDED, log_text(job)
    model = ModelFile.objects.get()
    assert (model.name, model.node, model.path) == ("tiny", local_node, str(dest))
    assert model.sha256 == sha256_of(model_bytes) and model.size_bytes == len(model_bytes)
    assert model.profile["architecture"] == "llama" and model.profile["block_count"] == 8
    assert model.created_by == admin_user
    assert dest.read_bytes() == model_bytes
    assert not Path(f"{dest}.part").exists() and not Path(f"{dest}.part.url").exists()
    log = log_text(job)
    # The console's own host: the URL was resolved and checked first, and curl is pinned to that address.
    assert "$ curl --fail --resolve 127.0.0.1:" in log and "--max-redirs 0" in log
    assert f"--output {dest}.part" in log
    assert re.search(r"^Downloaded (\d+\.\d) MiB of \1 MiB \(100%\) \(curl exit status 0\)$", log, re.M), log
    assert f"SHA-256 matches: {sha256_of(model_bytes)}" in log
    assert "Downloaded and registered tiny: llama, 8 blocks" in job.result
    register = AuditEvent.objects.get(action="model.register")
    assert register.actor_name == admin_user.username and register.changes["job"] == job.pk


def test_a_destination_ending_in_a_slash_takes_the_file_name_of_the_url(
    local_node,
    admin_client,
    server,
    sent,
    tmp_path,
):
    url = server.url("/models/tiny.gguf")
    response = post_download(admin_client, url=url, node=local_node.pk, dest=f"{tmp_path}/", name="Tiny")
    assert response.status_code == 302
    assert Job.objects.get().params["dest"] == f"{tmp_path}/tiny.gguf"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"url": "http://me:hunter2@127.0.0.1/x.gguf"},
            "A URL with a user name or password is not accepted.",
        ),
        ({"url": "ftp://127.0.0.1/x.gguf"}, "Only http and https URLs can be downloaded."),
        ({"dest": "models/x.gguf"}, "Give an absolute path."),
        ({"sha256": "abc"}, "A SHA-256 is 64 hexadecimal characters."),
    ],
)
def test_the_download_form_refuses_what_it_cannot_do_and_starts_nothing(
    local_node,
    admin_client,
    sent,
    fields,
    message,
):
    values = {"url": "http://127.0.0.1:9/x.gguf", "node": local_node.pk, "dest": "/tmp/x.gguf", **fields}
    response = post_download(admin_client, **values)
    assert response.status_code == 400
    assert message in html.unescape(response.content.decode())
    assert not Job.objects.exists() and sent == []
    assert "hunter2" not in str(list(AuditEvent.objects.values_list("changes", flat=True)))


def test_a_second_download_to_the_same_path_is_refused_while_the_first_is_active(
    local_node,
    admin_client,
    sent,
    tmp_path,
):
    dest = str(tmp_path / "tiny.gguf")
    fields = {"url": "http://127.0.0.1:9/tiny.gguf", "node": local_node.pk, "dest": dest}
    assert post_download(admin_client, **fields).status_code == 302
    response = post_download(admin_client, **fields, name="another name")
    assert response.status_code == 400
    assert "A download to this path on that node is already queued or running." in response.content.decode()
    assert Job.objects.count() == 1 and len(sent) == 1


def test_the_models_page_offers_the_download_form_to_operators_only(
    local_node,
    operator_client,
    client,
    viewer_user,
):
    page = operator_client.get(reverse("modelfiles:list")).content.decode()
    assert 'id="download-model"' in page
    assert 'name="download-url"' in page and 'name="download-sha256"' in page
    client.force_login(viewer_user)
    page = client.get(reverse("modelfiles:list")).content.decode()
    assert 'id="download-model"' not in page


def test_a_viewer_cannot_start_a_download(local_node, viewer_client, sent):
    response = post_download(
        viewer_client, url="http://127.0.0.1:9/x.gguf", node=local_node.pk, dest="/tmp/x"
    )
    assert response.status_code == 403
    assert not Job.objects.exists() and sent == []


# --------------------------------------------------------------------------------------------------
# The job on the console's own host (local transport)
# --------------------------------------------------------------------------------------------------


def test_a_partial_download_is_resumed_with_a_range_request(
    local_node,
    server,
    model_bytes,
    tmp_path,
):
    dest = tmp_path / "tiny.gguf"
    kept = len(model_bytes) // 3
    Path(f"{dest}.part").write_bytes(model_bytes[:kept])
    job = run(download(local_node, server.url("/models/tiny.gguf"), dest))
    assert job.state == JobState.SUCCEEDED, log_text(job)
    assert fetches(server) == [("GET", "/models/tiny.gguf", f"bytes={kept}-")]
    assert dest.read_bytes() == model_bytes
    assert ModelFile.objects.get().path == str(dest)


def test_a_dropped_connection_fails_keeping_the_part_and_the_next_run_fetches_only_the_rest(
    local_node,
    server,
    model_bytes,
    tmp_path,
):
    dest = tmp_path / "tiny.gguf"
    server.drop_after = 3 * 2**20
    job = run(download(local_node, server.url("/models/tiny.gguf"), dest))
    assert job.state == JobState.FAILED
    assert job.result.startswith("Download failed: curl: (18)")
    assert job.result.endswith("3.0 MiB are kept in tiny.gguf.part; start it again to resume.")
    assert Path(f"{dest}.part").stat().st_size == 3 * 2**20

    again = run(download(local_node, server.url("/models/tiny.gguf"), dest, sha256=sha256_of(model_bytes)))
    assert again.state == JobState.SUCCEEDED, log_text(again)
    assert "Resuming after the 3.0 MiB already in tiny.gguf.part." in log_text(again)
    assert [r for r in server.requests if r[0] == "GET"][-1][2] == f"bytes={3 * 2**20}-"
    assert dest.read_bytes() == model_bytes


def test_a_part_file_of_another_url_is_discarded_not_spliced(
    local_node,
    server,
    model_bytes,
    tmp_path,
):
    dest = tmp_path / "tiny.gguf"
    Path(f"{dest}.part").write_bytes(b"GGUF and the first bytes of some other model")
    Path(f"{dest}.part.url").write_text("http://127.0.0.1:9/other.gguf")
    job = run(download(local_node, server.url("/models/tiny.gguf"), dest))
    assert job.state == JobState.SUCCEEDED, log_text(job)
    assert "holds a download of another URL; starting over." in log_text(job)
    assert [r[2] for r in fetches(server)] == [None]
    assert dest.read_bytes() == model_bytes
    assert not Path(f"{dest}.part.url").exists()


def test_a_server_that_cannot_resume_gets_a_fresh_download(local_node, model_bytes, tmp_path):
    plain = RangeServer({"/tiny.gguf": model_bytes}, ranges=False)
    try:
        dest = tmp_path / "tiny.gguf"
        junk = b"junk from an older, different file"
        Path(f"{dest}.part").write_bytes(junk)
        job = run(download(local_node, plain.url("/tiny.gguf"), dest))
    finally:
        plain.close()
    assert job.state == JobState.SUCCEEDED, log_text(job)
    assert "The server cannot resume a download; starting over." in log_text(job)
    assert [r[2] for r in fetches(plain)] == [f"bytes={len(junk)}-", None]
    assert dest.read_bytes() == model_bytes


def test_a_slow_download_logs_its_progress(local_node, model_bytes, tmp_path):
    # 256 KiB every 0.1 s: the 9 MiB file takes about 4 s, so 1-second progress lines must appear.
    slow = RangeServer({"/tiny.gguf": model_bytes}, pause=0.1)
    try:
        job = run(download(local_node, slow.url("/tiny.gguf"), tmp_path / "tiny.gguf", progress_every=1))
    finally:
        slow.close()
    assert job.state == JobState.SUCCEEDED, log_text(job)
    progress = re.findall(
        r"^Downloaded (\d+\.\d) MiB of \d+\.\d MiB \((\d+)%\), \d+\.\d MiB/s$", log_text(job), re.M
    )
    assert progress, log_text(job)
    assert all(0 <= int(pct) <= 100 for _, pct in progress)
    assert [float(mib) for mib, _ in progress] == sorted(float(mib) for mib, _ in progress)


def test_a_cancelled_download_ends_curl_keeps_its_part_and_the_next_run_resumes(
    local_node,
    model_bytes,
    tmp_path,
):
    slow = RangeServer({"/tiny.gguf": model_bytes}, pause=0.1)
    dest = tmp_path / "tiny.gguf"
    part = Path(f"{dest}.part")
    try:
        job = download(local_node, slow.url("/tiny.gguf"), dest, progress_every=1)
        thread = threading.Thread(target=runner.run_job, args=(job.pk,), daemon=True)
        thread.start()
        wait_for(lambda: "MiB/s" in log_text(job), what="a progress line")
        assert Job.objects.get(pk=job.pk).request_cancel()
        thread.join(timeout=60)
        assert not thread.is_alive()
        job.refresh_from_db()
        assert job.state == JobState.CANCELLED, log_text(job)
        assert not [
            p for p in psutil.process_iter(["cmdline"]) if str(part) in " ".join(p.info["cmdline"] or [])
        ]
        kept = part.stat().st_size
        assert 0 < kept < len(model_bytes)
        assert not dest.exists() and not ModelFile.objects.exists()

        slow.pause = 0.0
        again = run(download(local_node, slow.url("/tiny.gguf"), dest, sha256=sha256_of(model_bytes)))
    finally:
        slow.close()
    assert again.state == JobState.SUCCEEDED, log_text(again)
    assert [r for r in slow.requests if r[0] == "GET"][-1] == ("GET", "/tiny.gguf", f"bytes={kept}-")
    assert dest.read_bytes() == model_bytes


def test_a_wrong_sha256_fails_naming_both_hashes_and_removes_the_download(
    local_node,
    server,
    model_bytes,
    tmp_path,
):
    dest = tmp_path / "tiny.gguf"
    wrong = "0" * 64
    job = run(download(local_node, server.url("/models/tiny.gguf"), dest, sha256=wrong))
    assert job.state == JobState.FAILED
    assert job.result == (
        f"SHA-256 mismatch: expected {wrong}, got {sha256_of(model_bytes)}. The downloaded file was removed."
    )
    assert not dest.exists() and not Path(f"{dest}.part").exists()
    assert not ModelFile.objects.exists()


def test_a_download_that_is_not_a_model_fails_with_the_reason_and_registers_nothing(
    local_node,
    server,
    tmp_path,
):
    dest = tmp_path / "notes.gguf"
    job = run(download(local_node, server.url("/notes.gguf"), dest))
    assert job.state == JobState.FAILED
    assert job.result.startswith("The download is not a usable model, so it was removed: This is not a GGUF")
    assert not dest.exists() and not ModelFile.objects.exists()


def test_an_http_error_fails_the_job_with_curls_message(local_node, server, tmp_path):
    job = run(download(local_node, server.url("/gone.gguf"), tmp_path / "gone.gguf"))
    assert job.state == JobState.FAILED
    assert job.result == "Download failed: curl: (22) The requested URL returned error: 404."
    assert not ModelFile.objects.exists()


def test_an_existing_destination_is_not_overwritten(local_node, server, tmp_path):
    dest = tmp_path / "tiny.gguf"
    dest.write_bytes(b"precious")
    job = run(download(local_node, server.url("/models/tiny.gguf"), dest))
    assert job.state == JobState.FAILED and "already exists" in job.result
    assert dest.read_bytes() == b"precious"
    assert not [r for r in server.requests if r[0] == "GET"]


def test_a_node_without_curl_fails_saying_so(local_node, server, tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("sh", "test", "mkdir", "rm", "mv", "wc"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(bin_dir))
    job = run(download(local_node, server.url("/models/tiny.gguf"), tmp_path / "tiny.gguf"))
    assert job.state == JobState.FAILED, (job.result, log_text(job))
    assert job.result == "curl is not installed on console-host; install it and start the download again."
    assert not server.requests


def test_a_complete_part_file_is_accepted_when_the_server_answers_416(
    local_node,
    server,
    model_bytes,
    tmp_path,
):
    dest = tmp_path / "tiny.gguf"
    Path(f"{dest}.part").write_bytes(model_bytes)
    job = run(download(local_node, server.url("/models/tiny.gguf"), dest, sha256=sha256_of(model_bytes)))
    assert job.state == JobState.SUCCEEDED, log_text(job)
    assert "The server says the part file is already complete." in log_text(job)
    assert ModelFile.objects.get().sha256 == sha256_of(model_bytes)


# --------------------------------------------------------------------------------------------------
# The job on a lab host over SSH, from a server on the host side of its veth
# --------------------------------------------------------------------------------------------------


@pytest.mark.lab
def test_a_lab_host_downloads_a_split_model_over_its_network_and_registers_it_over_sftp(
    lab, lab_host, settings, tmp_path
):
    settings.RAMDECK_SSH_CONNECT_TIMEOUT_S = 3.0
    (tmp_path / "src").mkdir()
    source = write_tiny_llama(tmp_path / "src" / "split.gguf", TinyLlama(shards=2))
    second = source.with_name("split-00002-of-00002.gguf")
    lab_server = RangeServer(
        {f"/{source.name}": source.read_bytes(), f"/{second.name}": second.read_bytes()},
        host=lab_host.host_address,
    )
    node = lab_node(lab, lab_host)
    dest_dir = tmp_path / "on-node"
    try:
        # The second shard first: its registration fails (it is not the first shard), but the file stays.
        job = run(download(node, lab_server.url(f"/{second.name}"), dest_dir / second.name, name="second"))
        assert job.state == JobState.FAILED
        assert (dest_dir / second.name).read_bytes() == second.read_bytes()
        job = run(download(node, lab_server.url(f"/{source.name}"), dest_dir / source.name, name="split"))
    finally:
        lab_server.close()
    assert job.state == JobState.SUCCEEDED, log_text(job)
    model = ModelFile.objects.get()
    assert model.node == node and model.profile["split_count"] == 2
    assert model.shard_paths == [str(dest_dir / source.name), str(dest_dir / second.name)]
    assert model.size_bytes == source.stat().st_size + second.stat().st_size
