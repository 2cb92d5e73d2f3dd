"""PostgreSQL restarted between two steps of a deployment run.

The console under test must run on a PostgreSQL server this test may restart, so the scenario
(tests/postgres_restart_scenario.py) runs in a pytest of its own whose whole database, its Celery workers'
included, is a private server started here. The machine's own PostgreSQL is never touched.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from django.conf import settings

from tests.private_postgres import PrivatePostgres

pytestmark = [pytest.mark.faults, pytest.mark.lab, pytest.mark.llamacpp, pytest.mark.timeout(1500)]

SCENARIO = "tests/postgres_restart_scenario.py"


def test_postgresql_restarted_between_two_steps_leaves_the_run_to_carry_on(figure):
    server = PrivatePostgres.create()
    try:
        server.start()
        env = {**os.environ, **server.environment()}
        argv = [sys.executable, "-m", "pytest", SCENARIO, "-q", "-s", "-p", "no:cacheprovider"]
        done = subprocess.run(
            argv, cwd=settings.BASE_DIR, env=env, capture_output=True, text=True, timeout=1400
        )
        print(done.stdout[-6000:])
        assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-4000:]
        assert "1 passed" in done.stdout, done.stdout[-4000:]
        for name, value in json.loads(re.search(r"^FAULTS (.+)$", done.stdout, re.M).group(1)).items():
            figure(name, value)
    finally:
        server.remove()
