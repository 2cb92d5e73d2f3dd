"""Fetch the pinned llama.cpp source and build the tests' llama.cpp once, before the suite starts.

`make test` runs this first so the download (about 15 s) and the compile (about 5 minutes on two cores, the
first time on a machine) are visible as their own step and not charged to one test's time limit. When
llama.cpp cannot be had it says why; under CI=true it then exits 1, elsewhere the tests that need it skip.
"""

from __future__ import annotations

import os
import sys
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ramdeck_site.settings")
django.setup()

from tests.llamacpp_build import LlamaCppUnavailable, llamacpp_binaries  # noqa: E402
from tests.unavailable import in_ci  # noqa: E402


def main() -> int:
    started = time.monotonic()
    try:
        found = llamacpp_binaries()
    except LlamaCppUnavailable as exc:
        print(f"llama.cpp is not available: {exc}", file=sys.stderr)
        return 1 if in_ci() else 0
    print(f"llama.cpp ready in {time.monotonic() - started:.0f} s: {found.rpc_server.parent}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
