"""Probing the console's own host with the real probe script and the real cached llama.cpp build."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodes.probe.collect import collect
from remote.local import LocalTransport
from tests.llamacpp_build import BUILD_ROOT, require_llamacpp

pytestmark = pytest.mark.llamacpp


@pytest.fixture
def build_in_home(tmp_path, monkeypatch):
    """The cached build, seen where the probe looks on a node: <HOME>/.ramdeck/llama.cpp/src-*/llama.cpp/
    build-*/bin. HOME is a fresh folder whose .ramdeck/llama.cpp links to the tests' build root."""
    build = require_llamacpp()
    (tmp_path / ".ramdeck").mkdir()
    (tmp_path / ".ramdeck" / "llama.cpp").symlink_to(BUILD_ROOT)
    monkeypatch.setenv("HOME", str(tmp_path))
    return build


async def _probe(**kwargs):
    async with LocalTransport() as transport:
        return await collect(transport, "auto", **kwargs)


async def test_the_build_cache_is_found_and_its_llama_server_asked_for_its_version(build_in_home):
    report = await _probe()
    assert Path(report.binaries["llama-server"]).resolve() == build_in_home.llama_server.resolve()
    assert report.llama_version  # what `llama-server --version` printed


async def test_a_llama_server_whose_version_the_console_knows_is_not_started_again(build_in_home):
    report = await _probe()
    known = report.binaries["llama-server"]
    # Had the script run the binary, its real version would be in the report instead of the known one.
    report = await _probe(known_server=(known, "recorded at build time"))
    assert report.llama_version == "recorded at build time"
    other = await _probe(known_server=("/some/other/llama-server", "stale"))
    assert other.llama_version not in ("", "stale")
