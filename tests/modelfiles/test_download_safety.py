"""Downloads and registrations on the console's own host: only into and from its model folders, only from
addresses an admin allows (each redirect checked before it is followed, redirects capped), and a download
URL's query (its token) never stored, logged or shown in plain text."""

from __future__ import annotations

import html
import re
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import psutil
import pytest
from django.urls import reverse

from audit.models import AuditEvent
from jobs import runner
from jobs.models import Job, JobState
from llamacpp.tiny_model import TinyLlama, write_tiny_llama
from modelfiles import fetch_policy
from modelfiles.download import curl_config
from modelfiles.models import ModelFile
from ramdeck_site import crypto
from tests.downloads import RangeServer, curl_reads_back, download, log_text, post_download, run

pytestmark = [pytest.mark.security, pytest.mark.django_db(transaction=True), pytest.mark.timeout(180)]

TOKEN = "hf_s3cr3tT0ken"


@pytest.fixture(autouse=True)
def private_channels(channel_layer):
    return channel_layer


@pytest.fixture
def models_dir(settings, tmp_path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    settings.RAMDECK_MODEL_DIRS = [str(folder)]
    return folder


@pytest.fixture
def model_bytes(tmp_path_factory) -> bytes:
    return write_tiny_llama(tmp_path_factory.mktemp("served") / "tiny.gguf", TinyLlama()).read_bytes()


@pytest.fixture
def server(model_bytes):
    instance = RangeServer({"/tiny.gguf": model_bytes})
    yield instance
    instance.close()


class Redirector:
    """Answers every request with a redirect to `target(path)`; records the requests it got."""

    def __init__(self, target, host: str = "127.0.0.1") -> None:
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.requests.append(self.path)
                self.send_response(302)
                self.send_header("Location", target(self.path))
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_GET

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# --------------------------------------------------------------------------------------------------
# Which addresses


@pytest.mark.parametrize(
    ("address", "refused"),
    [
        ("127.0.0.1", "loopback"),
        ("127.1.2.3", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("169.254.169.254", "link-local"),  # a cloud's metadata service
        ("fe80::1", "link-local"),
        ("10.0.0.1", "private"),
        ("172.16.5.4", "private"),
        ("192.168.1.1", "private"),  # the router
        ("fd00::1", "private"),
        ("0.0.0.0", "unspecified"),
        ("100.64.0.1", "not a public address"),  # carrier-grade NAT
        ("224.0.0.1", "not a public address"),
        ("93.184.216.34", ""),
        ("2606:4700::1111", ""),
    ],
)
def test_only_public_addresses_pass_by_default(settings, address, refused):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = []
    reason = fetch_policy.address_refusal(address)
    assert (refused in reason) if refused else reason == ""


def test_an_admin_allows_a_network_and_only_that_one(settings):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["192.168.1.0/24", "not a network"]
    assert fetch_policy.address_refusal("192.168.1.20") == ""
    assert "private" in fetch_policy.address_refusal("192.168.2.20")
    assert "loopback" in fetch_policy.address_refusal("127.0.0.1")


def test_the_query_is_hidden_wherever_a_url_is_shown():
    url = f"https://huggingface.co/org/m/resolve/main/m.gguf?download=true&token={TOKEN}#frag"
    assert fetch_policy.redact_url(url) == "https://huggingface.co/org/m/resolve/main/m.gguf?[query hidden]"
    assert fetch_policy.redact_url("http://[::1]:8080/a.gguf") == "http://[::1]:8080/a.gguf"


# --------------------------------------------------------------------------------------------------
# The form


def test_the_form_refuses_loopback_and_a_destination_outside_the_model_folder(
    local_node,
    admin_client,
    models_dir,
    settings,
    tmp_path,
):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = []
    fields = {
        "url": "http://localhost:8000/admin.gguf",
        "node": local_node.pk,
        "dest": f"{models_dir}/a.gguf",
    }
    page = html.unescape(post_download(admin_client, **fields).content.decode())
    assert (
        "127.0.0.1 is loopback: downloads on the console's own host fetch only from public addresses" in page
    )
    for dest in ("/usr/lib/python3/dist-packages/evil.pth", f"{models_dir}/../var/x.gguf", str(models_dir)):
        fields = {"url": "https://example.org/m.gguf", "node": local_node.pk, "dest": dest}
        response = post_download(admin_client, **fields)
        assert response.status_code == 400
        page = html.unescape(response.content.decode())
        assert f"On the console's own host a download goes into its model folder: {models_dir}." in page
    assert not Job.objects.exists()


def test_a_download_url_is_stored_logged_shown_and_audited_without_its_query(
    local_node,
    admin_client,
    models_dir,
    server,
    model_bytes,
    settings,
    monkeypatch,
):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.1/32"]
    monkeypatch.setattr(Job, "send_to_worker", lambda job: True)
    url = server.url(f"/tiny.gguf?token={TOKEN}")
    response = post_download(admin_client, url=url, node=local_node.pk, dest=f"{models_dir}/")
    assert response.status_code == 302, response.content.decode()[:3000]
    job = Job.objects.get()
    assert job.params["url"] == fetch_policy.redact_url(url) and TOKEN not in job.params["url"]
    assert crypto.decrypt(job.params["url_secret"]) == url  # the worker's copy, encrypted
    job = run(job)
    assert job.state == JobState.SUCCEEDED, log_text(job)
    assert server.requests[-1][1] == f"/tiny.gguf?token={TOKEN}"  # fetched with its token
    assert (models_dir / "tiny.gguf").read_bytes() == model_bytes
    assert TOKEN not in log_text(job) and "?[query hidden]" in log_text(job)
    audit = str(list(AuditEvent.objects.values_list("changes", flat=True)))
    assert TOKEN not in audit
    for page in (job.get_absolute_url(), reverse("jobs:list"), reverse("modelfiles:list")):
        assert TOKEN not in admin_client.get(page).content.decode()
    assert not list(models_dir.glob("*.url"))  # the resume record is gone, and never held the URL


# --------------------------------------------------------------------------------------------------
# The job: its destination, its targets, its redirects


def test_the_job_refuses_a_destination_outside_the_model_folder_even_through_a_symlink(
    local_node,
    models_dir,
    server,
    settings,
    tmp_path,
):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.1/32"]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (models_dir / "link").symlink_to(outside)
    for dest in (tmp_path / "x.gguf", models_dir / "link" / "x.gguf"):
        job = run(download(local_node, server.url("/tiny.gguf"), dest))
        assert job.state == JobState.FAILED
        assert job.result.startswith("Download refused: On the console's own host a download goes into")
    assert not server.requests and not list(outside.iterdir())


def test_a_name_that_resolves_to_loopback_is_refused_before_any_request(
    local_node,
    models_dir,
    server,
    settings,
):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = []
    port = server.server.server_address[1]
    job = run(download(local_node, f"http://localhost:{port}/tiny.gguf", models_dir / "tiny.gguf"))
    assert job.state == JobState.FAILED
    assert job.result.startswith("Download refused: localhost resolves to 127.0.0.1 is loopback")
    assert not server.requests and not ModelFile.objects.exists()


def test_a_redirect_to_an_address_not_allowed_is_refused_before_it_is_followed(
    local_node,
    models_dir,
    model_bytes,
    settings,
):
    # Only 127.0.0.1 is allowed; the redirect points at 127.0.0.2 (another loopback address, as a router's
    # or a metadata service's would be), where a server holds the file.
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.1/32"]
    inside = RangeServer({"/tiny.gguf": model_bytes}, host="127.0.0.2")
    hop = Redirector(lambda path: inside.url("/tiny.gguf") + f"?sig={TOKEN}")
    try:
        job = run(download(local_node, hop.url("/tiny.gguf"), models_dir / "tiny.gguf"))
    finally:
        hop.close()
        inside.close()
    assert job.state == JobState.FAILED
    assert job.result.startswith("Download refused: 127.0.0.2 is loopback"), job.result
    assert hop.requests == ["/tiny.gguf"] and inside.requests == []
    assert TOKEN not in log_text(job) + job.result


def test_an_allowed_redirect_chain_is_followed_hop_by_hop(
    local_node,
    models_dir,
    server,
    model_bytes,
    settings,
):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.1/32"]
    hop = Redirector(lambda path: server.url("/tiny.gguf") + f"?sig={TOKEN}")
    try:
        job = run(download(local_node, hop.url("/start.gguf"), models_dir / "tiny.gguf"))
    finally:
        hop.close()
    assert job.state == JobState.SUCCEEDED, log_text(job)
    log = log_text(job)
    assert f"Redirect 1 to {server.url('/tiny.gguf')}?[query hidden] (checked before it is followed)." in log
    assert TOKEN not in log and (models_dir / "tiny.gguf").read_bytes() == model_bytes


def test_redirects_are_capped(local_node, models_dir, settings):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.1/32"]
    settings.RAMDECK_DOWNLOAD_MAX_REDIRECTS = 3
    loop = Redirector(lambda path: f"/again{len(path)}")
    try:
        job = run(download(local_node, loop.url("/start"), models_dir / "tiny.gguf"))
    finally:
        loop.close()
    assert job.state == JobState.FAILED
    assert job.result == "Download refused: more than 3 redirects (RAMDECK_DOWNLOAD_MAX_REDIRECTS)."
    assert len(loop.requests) == 4


# --------------------------------------------------------------------------------------------------
# Register by path


def test_register_by_path_accepts_only_files_under_the_model_folders(
    local_node,
    admin_client,
    models_dir,
    tmp_path,
):
    outside = write_tiny_llama(tmp_path / "outside.gguf", TinyLlama())
    (models_dir / "link.gguf").symlink_to(outside)
    inside = write_tiny_llama(models_dir / "tiny.gguf", TinyLlama())
    for path in (outside, models_dir / "link.gguf", Path("/etc/passwd"), models_dir / ".." / "outside.gguf"):
        response = admin_client.post(
            reverse("modelfiles:register"), {"name": "m", "node": local_node.pk, "path": str(path)}
        )
        assert response.status_code == 400
        page = html.unescape(response.content.decode())
        assert "On the console's own host only files under its model folders can be registered" in page
    assert not ModelFile.objects.exists()
    response = admin_client.post(
        reverse("modelfiles:register"), {"name": "m", "node": local_node.pk, "path": str(inside)}
    )
    assert response.status_code == 302
    assert ModelFile.objects.get().path == str(inside)


# --------------------------------------------------------------------------------------------------
# IPv4 carried inside IPv6


@pytest.mark.parametrize(
    ("address", "carried"),
    [
        ("64:ff9b::7f00:1", "127.0.0.1"),  # NAT64, well-known prefix
        ("64:ff9b::a9fe:a9fe", "169.254.169.254"),
        ("2002:7f00:1::", "127.0.0.1"),  # 6to4
        ("2002:c0a8:101::1", "192.168.1.1"),
        ("::ffff:10.0.0.1", "10.0.0.1"),  # IPv4-mapped
        ("::127.0.0.1", "127.0.0.1"),  # IPv4-compatible (deprecated)
        ("::a9fe:a9fe", "169.254.169.254"),
    ],
)
def test_ipv4_carried_inside_ipv6_is_checked_as_the_ipv4_address(settings, address, carried):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = []
    reason = fetch_policy.address_refusal(address)
    assert reason.startswith(f"{address} carries the IPv4 address {carried}: {carried} is "), reason
    # The same through the form's quick check of an IP literal.
    assert fetch_policy.literal_refusal(f"http://[{address}]:8080/m.gguf") == reason


def test_public_ipv4_carried_inside_ipv6_passes_and_local_use_nat64_does_not(settings):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = []
    for address in ("64:ff9b::5db8:d822", "2002:5db8:d822::1", "::ffff:93.184.216.34"):
        assert fetch_policy.address_refusal(address) == "", address
    assert "local-use NAT64" in fetch_policy.address_refusal("64:ff9b:1::7f00:1")
    # An admin's allowance follows the carried address.
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.0/8"]
    assert fetch_policy.address_refusal("64:ff9b::7f00:1") == ""


# --------------------------------------------------------------------------------------------------
# The size cap and the free space


class Streamer:
    """A server that never announces its size: a one-byte answer to the range probe (`bytes 0-0/*`), then
    `chunk` bytes every `pause` seconds for as long as the client reads, over HTTP/1.0 without a length."""

    def __init__(self, chunk: int = 256 * 1024, pause: float = 0.05) -> None:
        self.requests: list[str | None] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self.send_response(200)
                self.end_headers()

            def do_GET(self) -> None:
                owner.requests.append(self.headers.get("Range"))
                if self.headers.get("Range") == "bytes=0-0":
                    self.send_response(206)
                    self.send_header("Content-Range", "bytes 0-0/*")
                    self.send_header("Content-Length", "1")
                    self.end_headers()
                    self.wfile.write(b"G")
                    return
                self.send_response(200)
                self.end_headers()
                try:
                    for _ in range(4000):  # 1 GiB at most, should nobody stop it
                        self.wfile.write(b"\0" * chunk)
                        self.wfile.flush()
                        time.sleep(pause)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Announcer:
    """Announces `size` bytes (to the one-byte range probe) and sends one."""

    def __init__(self, size: int) -> None:
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.requests.append(self.headers.get("Range") or "")
                self.send_response(206)
                self.send_header("Content-Range", f"bytes 0-0/{size}")
                self.send_header("Content-Length", "1")
                self.end_headers()
                self.wfile.write(b"G")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_download_larger_than_the_cap_is_refused_before_any_byte(local_node, models_dir, settings):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.1/32"]
    settings.RAMDECK_DOWNLOAD_MAX_BYTES = 2**30
    big = Announcer(5 * 2**30)
    try:
        job = run(download(local_node, big.url("/big.gguf"), models_dir / "big.gguf"))
    finally:
        big.close()
    assert job.state == JobState.FAILED
    assert job.result == (
        "Download refused: the server announces 5.0 GiB, more than the 1.0 GiB a download may write "
        "(RAMDECK_DOWNLOAD_MAX_BYTES)."
    )
    assert big.requests == ["bytes=0-0"] and not list(models_dir.iterdir())


def test_a_download_the_destination_has_no_room_for_is_refused_before_any_byte(
    local_node,
    models_dir,
    settings,
):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.1/32"]
    settings.RAMDECK_DOWNLOAD_MAX_BYTES = 2**62
    free = shutil.disk_usage(models_dir).free
    big = Announcer(free + 2**40)
    try:
        job = run(download(local_node, big.url("/big.gguf"), models_dir / "big.gguf"))
    finally:
        big.close()
    assert job.state == JobState.FAILED
    assert re.fullmatch(
        rf"Download refused: it needs [\d.]+ GiB more in {models_dir} on {local_node.name}, which has "
        r"[\d.]+ GiB free\.",
        job.result,
    ), job.result
    assert big.requests == ["bytes=0-0"] and list(models_dir.iterdir()) == []


def test_a_download_of_unannounced_size_is_stopped_past_the_cap_and_removed(
    local_node,
    models_dir,
    settings,
):
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.1/32"]
    settings.RAMDECK_DOWNLOAD_MAX_BYTES = 2 * 2**20
    endless = Streamer()
    started = time.monotonic()
    try:
        job = run(download(local_node, endless.url("/endless.gguf"), models_dir / "endless.gguf"))
    finally:
        endless.close()
    assert job.state == JobState.FAILED, log_text(job)
    assert job.result == (
        "Download stopped: the file is larger than 2.0 MiB, the most a download may write "
        "(RAMDECK_DOWNLOAD_MAX_BYTES); what was downloaded is removed."
    )
    log = log_text(job)
    assert "The server does not announce the size; the download stops if it passes 2.0 MiB." in log
    assert "(stopped: more than the 2.0 MiB a download may write)" in log
    assert time.monotonic() - started < 30
    assert list(models_dir.iterdir()) == [] and not ModelFile.objects.exists()


# --------------------------------------------------------------------------------------------------
# The URL never on a command line


@pytest.mark.parametrize(
    "url",
    [
        f"https://example.test/m.gguf?token={TOKEN}&x=1",
        'https://example.test/a"b\\c/m.gguf?sig="\\n"',
        'https://example.test/quote"\noutput = /tmp/evil\nurl = "https://evil.test/',
        "https://example.test/tab\there/é/😀.gguf#frag",
        "https://example.test/\x1b[31m\x7f\x01\r\v.gguf",
    ],
    ids=["token", "quotes and backslashes", "a line break adding an option", "tab and unicode", "controls"],
)
def test_curl_reads_back_exactly_the_url_from_its_config_line(url):
    config = curl_config(url).decode()
    assert config.startswith('url = "') and config.endswith('"\n') and config.count("\n") == 1
    assert curl_reads_back(url) == url


def test_a_url_with_a_nul_is_refused():
    from jobs.context import JobFailed

    with pytest.raises(JobFailed, match="The URL holds a NUL character"):
        curl_config("https://example.test/a\x00b")


def test_curls_command_line_never_shows_the_url(local_node, models_dir, model_bytes, settings):
    """`ps` on the console's host, read from /proc/PID/cmdline while the download runs."""
    settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS = ["127.0.0.1/32"]
    slow = RangeServer({"/tiny.gguf": model_bytes}, pause=0.1)  # about 4 s for the 9 MiB
    url = slow.url(f"/tiny.gguf?token={TOKEN}")
    job = download(local_node, url, models_dir / "tiny.gguf")
    seen: dict[int, str] = {}
    thread = threading.Thread(target=runner.run_job, args=(job.pk,), daemon=True)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            for child in psutil.Process().children(recursive=True):
                try:
                    cmdline = Path(f"/proc/{child.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                if "curl" in cmdline:
                    seen[child.pid] = cmdline
            time.sleep(0.05)
        thread.join(timeout=60)
    finally:
        slow.close()
    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, log_text(job)
    assert (models_dir / "tiny.gguf").read_bytes() == model_bytes
    assert slow.requests[-1][1] == f"/tiny.gguf?token={TOKEN}"  # curl did get the URL, with its token
    downloads = [c for c in seen.values() if "--output" in c and "--continue-at" in c]
    assert downloads, seen  # the download's own curl was seen running
    for cmdline in seen.values():
        assert TOKEN not in cmdline and "127.0.0.1:" + str(slow.server.server_address[1]) + "/" not in cmdline
        assert "http://" not in cmdline, cmdline
