"""pytest fixtures for the network-namespace lab: `lab` (a factory), `lab_host`, `lab_hosts(n)`.

A test that uses them is marked `lab`. When the machine cannot run the lab the test is skipped with the
reason, except under CI (`CI=true`), where a lab test that cannot run is a failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.lab.netlab import Lab, LabHost, LabUnavailable, cleanup_leftovers, ensure_sshd_installed
from tests.unavailable import unavailable

_leftovers_cleaned = False


def _cannot_run(reason: str) -> None:
    unavailable(f"lab unavailable: {reason}")


def _new_lab() -> Lab:
    global _leftovers_cleaned
    ensure_sshd_installed()
    try:
        if not _leftovers_cleaned:
            # Once per test process: clear what crashed earlier runs left behind.
            cleanup_leftovers()
            _leftovers_cleaned = True
        return Lab()
    except LabUnavailable as exc:
        _cannot_run(str(exc))
        raise  # unreachable: _cannot_run raises


@pytest.fixture
def lab(request) -> Iterator[Lab]:
    """A fresh lab for this test; `lab.add_host(...)` adds machines. Torn down even when the test fails."""
    instance = _new_lab()
    request.addfinalizer(instance.close)
    yield instance


@pytest.fixture
def lab_host(lab: Lab) -> LabHost:
    """One lab machine with sshd (key login as root)."""
    return lab.add_host()


@pytest.fixture
def lab_hosts(lab: Lab) -> Callable[[int], list[LabHost]]:
    """`lab_hosts(n)` creates n lab machines with sshd."""

    def make(n: int, **options) -> list[LabHost]:
        return [lab.add_host(**options) for _ in range(n)]

    return make
