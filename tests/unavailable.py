"""The one way a test says that something it needs is missing on this machine.

Outside CI the test is skipped with the reason; under CI (`CI=true`) it fails, because there every
component (the lab, Chromium, llama.cpp, the source tarball) must be present and a skip would hide it.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def unavailable(reason: str) -> NoReturn:
    """Skip the test with `reason`, or fail it under CI=true."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: this test must run)", pytrace=False)
    pytest.skip(reason)
