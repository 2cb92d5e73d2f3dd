"""Run the whole console in the foreground: web (daphne), the two Celery workers (long work, and control work
that must never wait behind it) and beat, and Redis if needed.

`make run` calls this. It prepares the database and the admin account, then hands the processes to honcho
(a Procfile runner), which prefixes their output and stops all of them on Ctrl-C.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand

from ramdeck_site import services

# Control work is short; two at once let a stop proceed while a probe waits on an unreachable node.
CONTROL_CONCURRENCY = 2


class Command(BaseCommand):
    help = (
        "Run the web server, the work and control Celery workers and beat (and a private Redis when none "
        "answers) under honcho."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default=os.environ.get("RAMDECK_HOST", "127.0.0.1"))
        parser.add_argument("--port", type=int, default=int(os.environ.get("RAMDECK_PORT", "8000")))
        parser.add_argument("--concurrency", type=int, default=int(os.environ.get("RAMDECK_WORKERS", "4")))

    def handle(self, *args, host: str, port: int, concurrency: int, **options):
        env = dict(os.environ)
        procfile = self._procfile(env, host, port, concurrency)
        os.environ.update(env)
        call_command("migrate", interactive=False, verbosity=0)
        call_command("collectstatic", interactive=False, verbosity=0)
        call_command("ensure_admin")
        shown_host = "localhost" if host in ("127.0.0.1", "0.0.0.0") else host
        self.stdout.write(
            self.style.SUCCESS(f"\nRAMDeck console: http://{shown_host}:{port}/  (Ctrl-C stops everything)")
        )
        self.stdout.write(
            f"Database: {settings.DATABASES['default']['NAME']} · Redis: {services.shown(env['REDIS_URL'])}\n"
        )
        honcho = str(Path(sys.executable).parent / "honcho")
        os.execve(honcho, [honcho, "-f", str(procfile), "-d", str(settings.BASE_DIR), "start"], env)

    def _procfile(self, env: dict[str, str], host: str, port: int, concurrency: int) -> Path:
        lines = []
        url = env.get("REDIS_URL") or services.DEFAULT_REDIS_URL
        if services.redis_answers(url):
            env["REDIS_URL"] = url
        else:
            # honcho supervises the private Redis like any other process, so Ctrl-C stops it too.
            # With a password of its own (var/redis_password), which the children get inside REDIS_URL.
            redis_port = services.free_port()
            workdir = settings.VAR_DIR / "redis"
            workdir.mkdir(parents=True, exist_ok=True)
            password = services.redis_password(settings.VAR_DIR)
            env["REDIS_URL"] = services.redis_url(redis_port, password)
            command = services.redis_command(redis_port, str(workdir), password)
            lines.append("redis: " + " ".join(_quoted(command)))
            self.stdout.write(
                f"No Redis answers at {services.shown(url)}; starting a private one on port {redis_port} "
                f"(password in {settings.VAR_DIR / 'redis_password'})."
            )
        lines += console_processes(host, port, concurrency)
        settings.VAR_DIR.mkdir(parents=True, exist_ok=True)
        procfile = settings.VAR_DIR / "Procfile"
        procfile.write_text("\n".join(lines) + "\n")
        return procfile


def console_processes(host: str, port: int, concurrency: int) -> list[str]:
    """Procfile lines of the console itself: the web server, the two workers and beat."""
    bin_dir = Path(sys.executable).parent
    celery = bin_dir / "celery"
    schedule = settings.VAR_DIR / "celerybeat-schedule"
    return [
        f"web: {bin_dir / 'daphne'} -b {host} -p {port} ramdeck_site.asgi:application",
        # Builds, downloads, deployments, commands: up to `concurrency` at once.
        f"worker: {celery} -A ramdeck_site worker -l INFO -c {concurrency} "
        f"-Q {settings.CELERY_TASK_DEFAULT_QUEUE} -n work@%h",
        # Stop, reap, probe, the monitor and the sweeper: never behind a build.
        f"control: {celery} -A ramdeck_site worker -l INFO -c {CONTROL_CONCURRENCY} "
        f"-Q {settings.RAMDECK_CONTROL_QUEUE} -n control@%h",
        f"beat: {celery} -A ramdeck_site beat -l INFO -s {schedule}",
    ]


def _quoted(argv: list[str]) -> list[str]:
    import shlex

    return [shlex.quote(arg) for arg in argv]
