"""Fetch the pinned llama.cpp source and build the tests' llama.cpp once per machine.

The suite runs this beside the tests that do not need llama.cpp (tests/llamacpp_background.py); run alone,
it builds ahead of a session. When llama.cpp cannot be had it says why; under CI=true it then exits 1,
elsewhere the tests that need it skip.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ramdeck_site.settings")
django.setup()

from tests.llamacpp_build import LlamaCppUnavailable, llamacpp_binaries
from tests.unavailable import in_ci


def end_with_parent(parent: int) -> None:
    """When the process that started this one (`parent`, given on the command line: read here it could
    already be a reaper's) goes away (a test session killed by its time limit or by SIGKILL, which runs no
    clean-up), end this process group, the compile with it (the group is ours: the session started it as a
    group of its own). Ninja ends the compilers it started when it is ended."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(2)
        os.killpg(os.getpgrp(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()


def main() -> int:
    for arg in sys.argv[1:]:
        if arg.startswith("--with-parent="):
            end_with_parent(int(arg.partition("=")[2]))
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
