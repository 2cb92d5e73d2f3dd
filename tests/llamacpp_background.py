"""Build llama.cpp beside the tests that do not need it (a pytest plugin, registered in tests/conftest.py).

On a machine that has never built it, the compile takes 5 to 11 minutes on two cores, and most of the suite
does not need it, while the test process rarely keeps both cores busy. So when the collected tests include
some that need llama.cpp (marked `llamacpp` or `e2e`) and its build is missing, the session starts
`python -m tests.prepare_llamacpp` at once, as a child process at the lowest CPU priority (`nice -n 19`:
the tests keep the CPU they ask for, the compile takes what they leave), runs the tests that do not need it
first, and waits for the build before the first one that does. The wait happens outside that test's time
limit (this hook wraps pytest-timeout's), and the terminal summary says how long the build took.

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

LOG = llamacpp_build.BUILD_ROOT / "build-beside-the-suite.log"


def needs_llamacpp(item: pytest.Item) -> bool:
    return any(item.get_closest_marker(name) for name in ("llamacpp", "e2e"))


class BackgroundBuild:
    def __init__(self, log: Path):
        self.log = log
        self.started = time.monotonic()
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
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
                    f"--with-parent={os.getpid()}",
                ],
                cwd=settings.BASE_DIR,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
        # Seconds from the start of the build to the first test that needed it (the wait's end).
        self.waited_s: float | None = None

    def wait(self) -> None:
        if self.waited_s is not None:
            return
        self.proc.wait()
        self.waited_s = time.monotonic() - self.started
        if llamacpp_build.built_binaries() is None:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-15:])
            llamacpp_build.BUILD_FAILURE = f"the build beside the suite failed (log {self.log}):\n{tail}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait()


_build: BackgroundBuild | None = None


def pytest_collection_finish(session: pytest.Session) -> None:
    global _build
    if session.config.option.collectonly or not any(needs_llamacpp(item) for item in session.items):
        return
    if llamacpp_build.built_binaries() is None:
        _build = BackgroundBuild(LOG)
        session.config.get_terminal_writer().line(
            f"llama.cpp is not built here yet: building it beside the tests that do not need it (log {LOG})"
        )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    building = _build is not None and _build.waited_s is None
    if building and needs_llamacpp(item):
        item.config.get_terminal_writer().line(f"\nwaiting for the llama.cpp build (log {LOG}) ...")
        _build.wait()
        building = False
    llamacpp_build.UNMARKED_TEST_DURING_BUILD = item.nodeid if building else None
    try:
        return (yield)
    finally:
        llamacpp_build.UNMARKED_TEST_DURING_BUILD = None


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _build is not None:
        _build.stop()


def pytest_terminal_summary(terminalreporter) -> None:
    if _build is None or _build.waited_s is None:
        return
    terminalreporter.section("llama.cpp")
    if llamacpp_build.BUILD_FAILURE:
        terminalreporter.write_line(f"the llama.cpp build beside the suite failed (log {LOG})")
    else:
        # Its own line ("llama.cpp ready in N s: ..."): how long the compile took beside the tests.
        last = (LOG.read_text(errors="replace").strip().splitlines() or [""])[-1]
        terminalreporter.write_line(f"built beside the suite: {last}")
    started = f"{_build.waited_s:.0f} s"
    terminalreporter.write_line(f"the first test that needed it started {started} after the build did")
