"""Fetch the pinned llama.cpp source and build the tests' llama.cpp once per machine (`--backend=vulkan`: the
Vulkan RPC server the tests marked `vulkan` run, tests/llamacpp_build.py).

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

from tests.llamacpp_build import CPU, VULKAN, LlamaCppUnavailable, llamacpp_binaries
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


FLAVOURS = {flavour.backend: flavour for flavour in (CPU, VULKAN)}


def main() -> int:
    flavour = CPU
    for arg in sys.argv[1:]:
        if arg.startswith("--with-parent="):
            end_with_parent(int(arg.partition("=")[2]))
        elif arg.startswith("--backend="):
            name = arg.partition("=")[2]
            if name not in FLAVOURS:
                print(f"--backend must be one of {', '.join(FLAVOURS)}, not {name!r}", file=sys.stderr)
                return 2
            flavour = FLAVOURS[name]
    started = time.monotonic()
    try:
        found = llamacpp_binaries(flavour)
    except LlamaCppUnavailable as exc:
        print(f"llama.cpp ({flavour.backend}) is not available: {exc}", file=sys.stderr)
        return 1 if in_ci() else 0
    took = time.monotonic() - started
    print(f"llama.cpp ({flavour.backend}) ready in {took:.0f} s: {found.rpc_server.parent}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
