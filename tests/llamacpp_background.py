"""Build llama.cpp beside the tests that do not need it (a pytest plugin, registered in tests/conftest.py).

On a machine that has never built it, the compile takes 5 to 11 minutes on two cores, and most of the suite
does not need it, while the test process rarely keeps both cores busy. So when the collected tests include
some that need llama.cpp (marked `llamacpp` or `e2e`) and its build is missing, the session starts
`python -m tests.prepare_llamacpp` at once, as a child process at the lowest CPU priority (`nice -n 19`:
the tests keep the CPU they ask for, the compile takes what they leave), runs the tests that do not need it
first, and waits for the build before the first one that does. The wait happens outside that test's time
limit (this hook wraps pytest-timeout's), and the terminal summary says how long the build took.

The Vulkan RPC server (tests marked `vulkan`, which run after every other test that needs llama.cpp and
before the browser tests) is built the same way, after the CPU build has finished (one compile at a time:
the CPU build is the one more tests wait for), or at once when the CPU build is there already.

A test that reaches for llama.cpp while the build runs without being marked fails at once and says so
(waiting on the build's lock inside its own time limit would end in a timeout that explains nothing).
A build that fails is reported by every test that needs llama.cpp, with the end of the build's log (under
CI=true as a failure, elsewhere as a skip), without a second attempt in the same session. An interrupted
session ends the build's process group by its PID, and a killed one (no clean-up runs) leaves the build
to notice that its parent is gone and end itself (`--with-parent`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings

from tests import llamacpp_build
from tests.llamacpp_build import CPU, VULKAN, Flavour

LOG = llamacpp_build.BUILD_ROOT / "build-beside-the-suite.log"
LOGS = {CPU.backend: LOG, VULKAN.backend: llamacpp_build.BUILD_ROOT / "build-vulkan-beside-the-suite.log"}


def needs_llamacpp(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in ("llamacpp", "e2e", "vulkan"))


def needs_vulkan(item: pytest.Item) -> bool:
    return item.get_closest_marker("vulkan") is not None


def needs(item: pytest.Item, flavour: Flavour) -> bool:
    return needs_vulkan(item) if flavour is VULKAN else needs_llamacpp(item)


class BackgroundBuild:
    def __init__(self, flavour: Flavour, log: Path):
        self.flavour, self.log = flavour, log
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        # Seconds from the start of the build to the first test that needed it (the wait's end).
        self.waited_s: float | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("w") as out:
            # A process group of its own (not a session: a new session would get a scheduler autogroup of
            # its own, beside which nice means little), so an interrupted run can end the whole group
            # (cmake, ninja, the compilers). From the project root, where `tests` imports, whatever folder
            # pytest was started in; told this process's PID, to end itself once that is gone.
            self.proc = subprocess.Popen(
                [
                    "nice",
                    "-n",
                    "19",
                    sys.executable,
                    "-m",
                    "tests.prepare_llamacpp",
                    f"--backend={self.flavour.backend}",
                    f"--with-parent={os.getpid()}",
                ],
                cwd=settings.BASE_DIR,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,
            )

    @property
    def finished(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def wait(self) -> None:
        if self.waited_s is not None:
            return
        if self.proc is None:
            self.start()
        self.proc.wait()
        self.waited_s = time.monotonic() - self.started
        if llamacpp_build.built_binaries(self.flavour) is None:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
            llamacpp_build.BUILD_FAILURES[self.flavour.backend] = (
                f"the {self.flavour.backend} build beside the suite failed (log {self.log}):\n{tail}"
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait()


_builds: dict[str, BackgroundBuild] = {}


def _start_vulkan_after_cpu() -> None:
    """Start the Vulkan build once no CPU build runs beside the suite (at most one compile at a time)."""
    vulkan, cpu = _builds.get(VULKAN.backend), _builds.get(CPU.backend)
    if vulkan is not None and vulkan.proc is None and (cpu is None or cpu.finished):
        vulkan.start()


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    for flavour in (CPU, VULKAN):
        if (
            any(needs(item, flavour) for item in session.items)
            and llamacpp_build.built_binaries(flavour) is None
        ):
            _builds[flavour.backend] = BackgroundBuild(flavour, LOGS[flavour.backend])
    if CPU.backend in _builds:
        _builds[CPU.backend].start()
    _start_vulkan_after_cpu()
    for backend, build in _builds.items():
        session.config.get_terminal_writer().line(
            f"llama.cpp ({backend}) is not built here yet: building it beside the tests that do not need it "
            f"(log {build.log})"
        )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    _start_vulkan_after_cpu()
    for flavour in (CPU, VULKAN):
        build = _builds.get(flavour.backend)
        building = build is not None and build.waited_s is None
        if building and needs(item, flavour):
            item.config.get_terminal_writer().line(
                f"\nwaiting for the llama.cpp {flavour.backend} build (log {build.log}) ..."
            )
            build.wait()
            _start_vulkan_after_cpu()
            building = False
        if building:
            llamacpp_build.UNMARKED_TEST_DURING_BUILD[flavour.backend] = item.nodeid
    try:
        return (yield)
    finally:
        llamacpp_build.UNMARKED_TEST_DURING_BUILD.clear()


def pytest_sessionfinish(session: pytest.Session) -> None:
    for build in _builds.values():
        build.stop()


def pytest_terminal_summary(terminalreporter) -> None:
    for backend, build in _builds.items():
        if build.waited_s is None:
            continue
        terminalreporter.section(f"llama.cpp ({backend})")
        if backend in llamacpp_build.BUILD_FAILURES:
            terminalreporter.write_line(
                f"the llama.cpp {backend} build beside the suite failed (log {build.log})"
            )
        else:
            # Its own line ("llama.cpp (cpu) ready in N s: ..."): how long the compile took beside the tests.
            last = (build.log.read_text(errors="replace").strip().splitlines() or [""])[-1]
            terminalreporter.write_line(f"built beside the suite: {last}")
        terminalreporter.write_line(
            f"the first test that needed it started {build.waited_s:.0f} s after the build did"
        )
