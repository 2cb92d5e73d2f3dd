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


class _FakeBuild:
    """A background build that records when it is started, finished when told."""

    def __init__(self, started: list, done: bool = False):
        self.proc, self.done, self.started = None, done, started

    @property
    def finished(self) -> bool:
        return self.done

    def start(self) -> None:
        self.started.append(self)
        self.proc = object()


def test_the_vulkan_build_beside_the_suite_starts_once_no_cpu_build_runs(monkeypatch):
    from tests import llamacpp_background as background

    started: list = []
    cpu, vulkan = _FakeBuild(started), _FakeBuild(started)
    monkeypatch.setattr(background, "_builds", {"cpu": cpu, "vulkan": vulkan})
    background._start_vulkan_after_cpu()
    assert started == []  # one compile at a time: the CPU build, which more tests wait for, first
    cpu.done = True
    background._start_vulkan_after_cpu()
    background._start_vulkan_after_cpu()
    assert started == [vulkan]
    alone = _FakeBuild(started)  # the CPU build was cached: the Vulkan one starts at once
    monkeypatch.setattr(background, "_builds", {"vulkan": alone})
    background._start_vulkan_after_cpu()
    assert started == [vulkan, alone]


def test_a_test_reaching_for_the_vulkan_build_while_it_runs_unmarked_fails_at_once(monkeypatch):
    monkeypatch.setitem(llamacpp_build.UNMARKED_TEST_DURING_BUILD, "vulkan", "tests/x.py::test_y")
    monkeypatch.setattr(llamacpp_build, "built_binaries", lambda flavour=llamacpp_build.CPU: None)
    with pytest.raises(AssertionError, match="tests/x.py::test_y needs the vulkan llama.cpp build.*`vulkan`"):
        llamacpp_build.llamacpp_binaries(llamacpp_build.VULKAN)
