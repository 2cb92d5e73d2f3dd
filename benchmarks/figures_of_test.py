"""Run one pytest test in a subprocess and return the JSON figures it printed on a line `PREFIX {...}`.

The lifecycle and worker-loss benchmarks measure through real tests (the lab, real llama.cpp); this is how
they read what a round measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def figures_from_test(test: str, prefix: str, *, timeout: float) -> dict:
    result = subprocess.run(
        [str(ROOT / ".venv/bin/pytest"), test, "-q", "-s", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    for line in result.stdout.splitlines():
        if line.startswith(f"{prefix} "):
            return json.loads(line[len(prefix) + 1 :])
    sys.stderr.write(result.stdout[-3000:] + result.stderr[-2000:])
    raise SystemExit(f"{test} did not report its figures (did it fail?)")
