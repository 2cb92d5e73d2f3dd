"""No fixed secrets: generated on first start (once, even by processes starting together), never a value
that was published in this repository, and a compose file that carries none."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import CommandError

from ramdeck_site.settings import PUBLISHED_SECRETS
from tests.paths import ROOT

PRINT_SECRETS = (
    "from django.conf import settings as s; print(s.SECRET_KEY, ','.join(s.RAMDECK_ENCRYPTION_KEYS))"
)


def _start(tmp_path: Path, **env: str) -> subprocess.Popen:
    """A console process start (settings loaded) with a fresh var folder and exactly these secrets."""
    clean = {k: v for k, v in os.environ.items() if k not in PUBLISHED_SECRETS}
    return subprocess.Popen(
        [sys.executable, "manage.py", "shell", "-c", PRINT_SECRETS],
        cwd=ROOT,
        env={**clean, "DEBUG": "0", "RAMDECK_VAR_DIR": str(tmp_path), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen) -> tuple[int, str, str]:
    out, err = process.communicate(timeout=120)
    return process.returncode, out, err


@pytest.mark.parametrize(
    ("name", "value"),
    [(name, value) for name, values in PUBLISHED_SECRETS.items() for value in sorted(values)],
)
def test_a_secret_published_in_the_repository_stops_the_console_naming_the_variable(tmp_path, name, value):
    code, _, err = _finish(_start(tmp_path, **{name: value}))
    assert code != 0
    assert "ImproperlyConfigured" in err and f"{name} is set to a value published" in err


def test_a_published_key_in_the_var_folder_stops_the_console_too(tmp_path):
    [published] = PUBLISHED_SECRETS["RAMDECK_SECRET_KEY"]
    (tmp_path / "secret_key").write_text(published + "\n")
    code, _, err = _finish(_start(tmp_path))
    assert code != 0 and "RAMDECK_SECRET_KEY is set to a value published" in err


def test_processes_starting_together_on_a_fresh_volume_generate_one_set_of_keys(tmp_path):
    # Empty values are what compose passes for unset `${NAME:-}`: they mean "generate".
    processes = [_start(tmp_path, RAMDECK_SECRET_KEY="", RAMDECK_ENCRYPTION_KEYS="") for _ in range(4)]
    results = [_finish(p) for p in processes]
    assert all(code == 0 for code, _, _ in results), [err for _, _, err in results]
    printed = {out.strip().splitlines()[-1] for _, out, _ in results}
    assert len(printed) == 1
    secret_key, encryption_key = printed.pop().split()
    assert (tmp_path / "secret_key").read_text().strip() == secret_key and len(secret_key) >= 50
    assert (tmp_path / "encryption_key").read_text().strip() == encryption_key
    assert oct((tmp_path / "secret_key").stat().st_mode & 0o777) == "0o600"
    # The console's id (tags of what it installs on nodes) is generated beside them; it is no secret.
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == [
        "console_id",
        "encryption_key",
        "secret_key",
    ]


@pytest.mark.django_db
def test_an_admin_still_on_a_published_password_stops_ensure_admin(monkeypatch):
    monkeypatch.delenv("RAMDECK_ADMIN_PASSWORD", raising=False)
    [published] = PUBLISHED_SECRETS["RAMDECK_ADMIN_PASSWORD"]
    get_user_model().objects.create_superuser(username="admin", email="", password=published)
    with pytest.raises(CommandError, match="admin still use a password published"):
        call_command("ensure_admin")


def test_the_compose_file_fixes_no_secret_and_publishes_the_console_on_loopback():
    text = (ROOT / "docker-compose.yml").read_text()
    compose = yaml.safe_load(text)
    services = compose["services"]
    assert {"postgres", "redis", "web", "worker", "beat", "demo-node-1", "demo-node-2"} <= set(services)
    for published in set().union(*PUBLISHED_SECRETS.values()):
        assert published not in text
    env = services["web"]["environment"]
    for name in PUBLISHED_SECRETS:
        assert env[name] == f"${{{name}:-}}", f"{name} must default to empty (generated on first start)"
    assert services["web"]["ports"] == ["${RAMDECK_BIND:-127.0.0.1}:${RAMDECK_PORT:-8000}:8000"]
    # A user's machine pulls the official images; only the test's override swaps them.
    assert services["postgres"]["image"] == "postgres:16" and services["redis"]["image"] == "redis:7"
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    for name in ("worker", "beat"):
        assert services[name]["build"] == services["web"]["build"] == "."
        assert services[name]["environment"] == env
    assert "ARG PYTHON_IMAGE=python:3.12-slim-bookworm" in (ROOT / "Dockerfile").read_text()


@pytest.mark.security
def test_the_compose_file_fixes_no_service_password_and_keeps_the_demo_nodes_off_the_backend_network():
    text = (ROOT / "docker-compose.yml").read_text()
    services = yaml.safe_load(text)["services"]
    assert "ramdeck:ramdeck@" not in text and "--requirepass" not in text
    # The console reads both passwords from the files the `secrets` service generates: no URL carries one.
    for name, service in services.items():
        for variable in ("DATABASE_URL", "REDIS_URL"):
            if variable in service.get("environment", {}):
                assert urlsplit(service["environment"][variable]).password is None, (name, variable)
    env = services["web"]["environment"]
    assert env["DATABASE_PASSWORD_FILE"] == "/run/ramdeck-secrets/postgres_password"
    assert env["REDIS_PASSWORD_FILE"] == "/run/ramdeck-secrets/redis_password"
    postgres, redis = services["postgres"], services["redis"]
    assert "POSTGRES_PASSWORD" not in postgres["environment"]
    assert postgres["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/ramdeck-secrets/postgres_password"
    assert redis["command"][:2] == ["redis-server", "/run/ramdeck-secrets/redis.conf"]
    # Generated before either server starts, into a volume no demo node mounts.
    secrets = services["secrets"]
    assert secrets["command"][-2:] == ["ramdeck_site.compose_secrets", "/run/ramdeck-secrets"]
    assert secrets["network_mode"] == "none" and secrets["volumes"] == [
        "service-secrets:/run/ramdeck-secrets"
    ]
    for name in ("postgres", "redis", "web"):
        assert services[name]["depends_on"]["secrets"] == {"condition": "service_completed_successfully"}
    # Two networks: the demo nodes (where operators run commands as root) share none with PostgreSQL or Redis.
    networks = {name: sorted(service.get("networks", [])) for name, service in services.items()}
    assert networks["postgres"] == networks["redis"] == networks["beat"] == ["backend"]
    assert networks["demo-node-1"] == networks["demo-node-2"] == ["nodes"]
    assert networks["web"] == networks["worker"] == networks["control"] == ["backend", "nodes"]
    for node in ("demo-node-1", "demo-node-2"):
        mounted = {volume.split(":")[0] for volume in services[node]["volumes"]}
        assert not mounted & {"service-secrets", "ramdeck", "pgdata", "redisdata"}, node
