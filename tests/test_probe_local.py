"""Probing the console's own host with the real probe script and the real cached llama.cpp build."""

from __future__ import annotations

import pytest

from jobs.local import LocalTransport
from nodes.probing import collect
from tests.llamacpp_build import require_llamacpp

pytestmark = pytest.mark.llamacpp


def _home_of(build) -> str:
    """The HOME whose build cache holds this build: <home>/.ramdeck/llama.cpp/src-*/llama.cpp/build-*."""
    return str(build.build_dir.parents[4])


async def _probe(**kwargs):
    async with LocalTransport() as transport:
        return await collect(transport, "auto", **kwargs)


async def test_the_build_cache_is_found_and_its_llama_server_asked_for_its_version(monkeypatch):
    build = require_llamacpp()
    monkeypatch.setenv("HOME", _home_of(build))
    report = await _probe()
    assert report.binaries["llama-server"] == str(build.llama_server)
    assert report.llama_version  # what `llama-server --version` printed


async def test_a_llama_server_whose_version_the_console_knows_is_not_started_again(monkeypatch, tmp_path):
    build = require_llamacpp()
    monkeypatch.setenv("HOME", _home_of(build))
    # Had the script run the binary, its real version would be in the report instead of the known one.
    report = await _probe(known_server=(str(build.llama_server), "recorded at build time"))
    assert report.llama_version == "recorded at build time"
    other = await _probe(known_server=("/some/other/llama-server", "stale"))
    assert other.llama_version not in ("", "stale")
