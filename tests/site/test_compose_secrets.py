"""The compose trial's PostgreSQL and Redis passwords: generated once by its `secrets` service into the volume
the servers and the console share, and read by the console from those files (none is in docker-compose.yml;
tests/compose/test_compose.py runs the whole stack)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from tests.paths import ROOT

pytestmark = [pytest.mark.security, pytest.mark.timeout(120)]

PRINT_SERVICES = (
    "import json; from django.conf import settings as s; print(json.dumps({"
    "'db_password': s.DATABASES['default']['PASSWORD'], 'db_user': s.DATABASES['default']['USER'], "
    "'db_host': s.DATABASES['default']['HOST'], 'redis': s.REDIS_URL, 'broker': s.CELERY_BROKER_URL, "
    "'channels': s.CHANNEL_LAYERS['default']['CONFIG']['hosts']}))"
)
_SERVICE_VARIABLES = ("DATABASE_URL", "DATABASE_PASSWORD_FILE", "REDIS_URL", "REDIS_PASSWORD_FILE")


def _settings(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Load the console's settings in a fresh process with exactly these service variables."""
    clean = {k: v for k, v in os.environ.items() if k not in _SERVICE_VARIABLES}
    return subprocess.run(
        [sys.executable, "-c", f"import django; django.setup(); {PRINT_SERVICES}"],
        cwd=ROOT,
        env={
            **clean,
            "DJANGO_SETTINGS_MODULE": "ramdeck_site.settings",
            "DEBUG": "0",
            "RAMDECK_VAR_DIR": str(tmp_path / "var"),
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


def _generate(folder: Path, var: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ramdeck_site.compose_secrets", str(folder)],
        cwd=ROOT,
        env={**os.environ, "RAMDECK_VAR_DIR": str(var)},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_secrets_service_generates_both_passwords_once_and_keeps_them(tmp_path):
    folder, var = tmp_path / "service-secrets", tmp_path / "var"
    folder.mkdir()
    first = _generate(folder, var)
    assert first.returncode == 0, first.stderr
    files = {
        name: (folder / name).read_text() for name in ("postgres_password", "redis_password", "redis.conf")
    }
    postgres, redis_password = files["postgres_password"].strip(), files["redis_password"].strip()
    assert len(postgres) >= 40 and len(redis_password) >= 40 and postgres != redis_password
    assert files["redis.conf"] == f"requirepass {redis_password}\n"
    assert sorted(p.name for p in folder.iterdir()) == ["postgres_password", "redis.conf", "redis_password"]
    for name in ("postgres_password", "redis_password"):
        assert stat.S_IMODE((folder / name).stat().st_mode) == 0o600
    conf = (folder / "redis.conf").stat()
    assert stat.S_IMODE(conf.st_mode) == 0o400
    if os.geteuid() == 0:
        # redis-server runs as the official image's redis user and reads its config as that user.
        assert (conf.st_uid, conf.st_gid) == (999, 999)

    # A second start (every `up` runs the service) keeps every password: PostgreSQL's database has it.
    again = _generate(folder, var)
    assert again.returncode == 0, again.stderr
    assert {name: (folder / name).read_text() for name in files} == files
    # Plain Python: the service generated none of the console's own keys (it has no volume for them).
    assert not var.exists()


def test_the_secrets_service_refuses_an_emptied_password_and_a_missing_folder(tmp_path):
    folder = tmp_path / "service-secrets"
    missing = _generate(folder, tmp_path / "var")
    assert missing.returncode != 0 and f"{folder} is not a folder" in missing.stderr
    folder.mkdir()
    (folder / "postgres_password").write_text("\n")
    emptied = _generate(folder, tmp_path / "var")
    assert emptied.returncode != 0 and "postgres_password is empty" in emptied.stderr
    assert not (folder / "redis.conf").exists()


def test_the_console_builds_its_database_and_broker_logins_from_the_password_files(tmp_path):
    # Characters that need quoting in a URL, so the Redis URL is proven to carry the password intact.
    (tmp_path / "pg").write_text("pg/pass@word:1\n")
    (tmp_path / "redis").write_text("re dis:p@ss/2\n")
    result = _settings(
        tmp_path,
        DATABASE_URL="postgres://ramdeck@postgres:5432/ramdeck",
        DATABASE_PASSWORD_FILE=str(tmp_path / "pg"),
        REDIS_URL="redis://redis:6379/0",
        REDIS_PASSWORD_FILE=str(tmp_path / "redis"),
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert (seen["db_user"], seen["db_host"], seen["db_password"]) == (
        "ramdeck",
        "postgres",
        "pg/pass@word:1",
    )
    assert seen["broker"] == seen["redis"] and seen["channels"] == [seen["redis"]]
    parsed = redis.connection.parse_url(seen["redis"])
    assert (parsed["host"], parsed["port"], parsed["db"], parsed["password"]) == (
        "redis",
        6379,
        0,
        "re dis:p@ss/2",
    )


def test_without_password_files_the_urls_are_used_as_they_are(tmp_path):
    result = _settings(tmp_path, REDIS_URL="redis://:own@127.0.0.1:6379/3", DATABASE_PASSWORD_FILE="")
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["redis"] == "redis://:own@127.0.0.1:6379/3" and seen["db_password"] in ("", None)


@pytest.mark.parametrize(
    ("variable", "problem", "message"),
    [
        ("DATABASE_PASSWORD_FILE", "missing", "which cannot be read: No such file or directory"),
        ("REDIS_PASSWORD_FILE", "missing", "which cannot be read: No such file or directory"),
        ("DATABASE_PASSWORD_FILE", "empty", "which is empty"),
        ("REDIS_PASSWORD_FILE", "empty", "which is empty"),
    ],
)
def test_a_password_file_that_cannot_be_used_stops_the_start_naming_it(tmp_path, variable, problem, message):
    path = tmp_path / "password"
    if problem == "empty":
        path.write_text("\n")
    result = _settings(tmp_path, **{variable: str(path)})
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr and f"{variable} names {path}, {message}" in result.stderr


@pytest.mark.parametrize(
    ("url_variable", "url", "file_variable"),
    [
        ("DATABASE_URL", "postgres://ramdeck:ramdeck@postgres:5432/ramdeck", "DATABASE_PASSWORD_FILE"),
        ("REDIS_URL", "redis://:other@redis:6379/0", "REDIS_PASSWORD_FILE"),
    ],
)
def test_a_password_in_the_url_and_a_password_file_together_are_refused(
    tmp_path, url_variable, url, file_variable
):
    (tmp_path / "password").write_text("generated\n")
    result = _settings(tmp_path, **{url_variable: url, file_variable: str(tmp_path / "password")})
    assert result.returncode != 0
    assert f"{url_variable} carries a password and {file_variable} names a file with another" in result.stderr
