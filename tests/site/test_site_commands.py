"""The commands behind `make run` and `make test`: admin bootstrap, deploy checks, service discovery."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command

from ramdeck_site import services
from ramdeck_site import settings as site_settings
from tests.paths import ROOT


@pytest.mark.django_db
def test_ensure_admin_creates_one_admin_with_the_given_password(monkeypatch, capsys):
    monkeypatch.setenv("RAMDECK_ADMIN_PASSWORD", "from-the-environment-42")
    call_command("ensure_admin")
    call_command("ensure_admin")  # idempotent
    admins = get_user_model().objects.filter(is_superuser=True)
    assert admins.count() == 1
    assert admins.get().check_password("from-the-environment-42")
    assert admins.get().groups.filter(name="admin").exists()
    assert "from-the-environment-42" not in capsys.readouterr().out


@pytest.mark.django_db
def test_ensure_admin_generates_and_prints_a_password_once(monkeypatch, capsys):
    monkeypatch.delenv("RAMDECK_ADMIN_PASSWORD", raising=False)
    call_command("ensure_admin")
    first = capsys.readouterr().out
    password = first.split("password: ")[1].split()[0]
    assert get_user_model().objects.get(username="admin").check_password(password)
    call_command("ensure_admin")
    assert password not in capsys.readouterr().out


def test_check_deploy_with_production_settings_reports_no_unjustified_warning(tmp_path):
    env = {
        **os.environ,
        "DEBUG": "0",
        "RAMDECK_SECRET_KEY": "x" * 20 + "production-secret-key-with-enough-entropy-0123456789",
        "RAMDECK_ENCRYPTION_KEYS": "a2V5LWZvci10ZXN0cy0zMi1ieXRlcy1sb25nLi4uLi4=",
        "RAMDECK_VAR_DIR": str(tmp_path),
    }
    # Browser tests relax async safety for their own thread; a deployment never does.
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    result = subprocess.run(
        [sys.executable, "manage.py", "check", "--deploy", "--fail-level", "WARNING"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "System check identified no issues" in result.stdout


def test_behind_tls_every_https_protection_is_on(tmp_path):
    env = {
        **os.environ,
        "DEBUG": "0",
        "RAMDECK_HTTPS": "1",
        "RAMDECK_VAR_DIR": str(tmp_path),
        "RAMDECK_SECRET_KEY": "y" * 60,
    }
    code = (
        "from django.conf import settings as s; "
        "print(s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE, s.SECURE_SSL_REDIRECT, s.SECURE_HSTS_SECONDS, "
        "sorted(s.SILENCED_SYSTEM_CHECKS))"
    )
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.strip().splitlines()[-1] == "True True True 31536000 ['security.W021']"


@pytest.mark.parametrize(
    ("helper", "value", "message"),
    [
        (lambda: site_settings.env_bool("X_FLAG", False), "perhaps", "X_FLAG must be a boolean"),
        (lambda: site_settings.env_int("X_NUM", 1, minimum=1), "zero", "X_NUM must be a whole number"),
        (
            lambda: site_settings.env_int("X_NUM", 1, minimum=1, maximum=9),
            "10",
            "X_NUM must be between 1 and 9",
        ),
    ],
)
def test_bad_environment_values_stop_start_up_naming_the_variable(monkeypatch, helper, value, message):
    monkeypatch.setenv("X_FLAG", value)
    monkeypatch.setenv("X_NUM", value)
    with pytest.raises(ImproperlyConfigured, match=message):
        helper()


def test_services_wrapper_starts_a_private_redis_when_none_answers():
    unused = f"redis://127.0.0.1:{services.free_port()}/0"
    probe = "import os, redis; url = os.environ['REDIS_URL']; print(url, redis.Redis.from_url(url).ping())"
    env = {**os.environ, "REDIS_URL": unused}
    result = subprocess.run(
        [sys.executable, "-m", "ramdeck_site.services", "--", sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    url_line = result.stdout.strip().splitlines()[-1]
    private_url, pong = url_line.split()
    assert private_url != unused and pong == "True"
    assert not services.redis_answers(private_url), "the private Redis must be stopped on exit"


def test_services_wrapper_uses_the_redis_that_answers():
    env = {**os.environ, "REDIS_URL": os.environ.get("REDIS_URL", services.DEFAULT_REDIS_URL)}
    if not services.redis_answers(env["REDIS_URL"]):
        pytest.fail(f"The test run itself should have a Redis at {env['REDIS_URL']}")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ramdeck_site.services",
            "--",
            sys.executable,
            "-c",
            "import os; print(os.environ['REDIS_URL'])",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.stdout.strip().splitlines()[-1] == env["REDIS_URL"]


def test_services_wrapper_passes_on_the_exit_status():
    result = subprocess.run(
        [sys.executable, "-m", "ramdeck_site.services", "--", "false"],
        cwd=ROOT,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 1
