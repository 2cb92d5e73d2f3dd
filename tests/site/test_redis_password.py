"""The Redis the console starts when none answers has a password of its own, which only its children get."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from ramdeck_site import services
from tests.paths import ROOT

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]


# Run by the wrapper as its child: what the child sees, and what anyone without the password gets.
CHILD = """
import os, psutil, redis
url = os.environ["REDIS_URL"]
password = redis.connection.parse_url(url).get("password")
print("PING", redis.Redis.from_url(url).ping())
bare = url.replace(f":{password}@", "")
try:
    redis.Redis.from_url(bare).ping()
    print("BARE", "answered")
except redis.exceptions.AuthenticationError as exc:
    print("BARE", "refused:", exc)
cmdlines = [" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])]
print("IN_PS", any(password in line for line in cmdlines))
print("URL", url)
"""


def test_the_private_redis_needs_the_generated_password(tmp_path):
    unused = f"redis://127.0.0.1:{services.free_port()}/0"
    env = {**os.environ, "REDIS_URL": unused, "RAMDECK_VAR_DIR": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "ramdeck_site.services", "--", sys.executable, "-c", CHILD],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    seen = dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line and line[:1] != "[")
    password = (tmp_path / "redis_password").read_text().strip()
    assert len(password) >= 32
    assert stat.S_IMODE((tmp_path / "redis_password").stat().st_mode) == 0o600
    assert seen["PING"] == "True"
    assert seen["BARE"].startswith("refused:")  # no password, no broker
    assert seen["IN_PS"] == "False"  # not on redis-server's command line
    assert seen["URL"].startswith(f"redis://:{password}@127.0.0.1:")
    assert password not in result.stdout.replace(seen["URL"], "")  # the wrapper prints it masked
    assert not services.redis_answers(seen["URL"]), "the private Redis must be stopped on exit"


def test_the_password_is_made_once_and_kept(tmp_path):
    first = services.redis_password(tmp_path)
    assert services.redis_password(tmp_path) == first
    assert services.redis_url(6399, first) == f"redis://:{first}@127.0.0.1:6399/0"
    assert services.shown(services.redis_url(6399, first)) == "redis://:•••@127.0.0.1:6399/0"


def test_make_run_gives_its_private_redis_the_password_through_a_config_file(settings, tmp_path):
    from ramdeck_site.management.commands.console import Command

    settings.VAR_DIR = tmp_path
    env = {"REDIS_URL": f"redis://127.0.0.1:{services.free_port()}/0"}
    procfile = Command()._procfile(env, "127.0.0.1", 8000, 2)
    password = (tmp_path / "redis_password").read_text().strip()
    assert env["REDIS_URL"].startswith(f"redis://:{password}@127.0.0.1:")
    redis_line = next(line for line in procfile.read_text().splitlines() if line.startswith("redis:"))
    assert password not in procfile.read_text()
    conf = tmp_path / "redis" / "ramdeck-redis.conf"
    assert str(conf) in redis_line and conf.read_text() == f"requirepass {password}\n"
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
