"""The test suite's own helpers: one "skip, or fail under CI" rule, and the llama.cpp build located the
way the console's build job lays it out."""

from __future__ import annotations

import pytest

from llamacpp.source import file_sha256
from llamacpp.versions import src_dir_name
from tests import llamacpp_build
from tests.unavailable import unavailable


def test_a_missing_component_skips_the_test_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no chromium here"):
        unavailable("no chromium here")


def test_a_missing_component_fails_the_test_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no chromium here.*CI=true"):
        unavailable("no chromium here")


@pytest.mark.llamacpp
def test_the_test_build_lives_where_the_console_build_job_puts_a_tarball_build():
    if not llamacpp_build.TARBALL.exists():
        unavailable(f"the llama.cpp source tarball is missing ({llamacpp_build.TARBALL})")
    found = llamacpp_build.require_llamacpp()
    tree = llamacpp_build.BUILD_ROOT / src_dir_name(file_sha256(str(llamacpp_build.TARBALL))) / "llama.cpp"
    assert found.build_dir == tree / "build-cpu"
    assert found.rpc_server.name in ("ggml-rpc-server", "rpc-server")
    assert found.llama_server == tree / "build-cpu" / "bin" / "llama-server"
