"""Drive the real docker-compose.yml (plus the stand-in override) as one uniquely named compose project.

Each test run gets its own project name (`ramdeck-test-<pid>`), so its containers, volumes and network are
labelled with it: teardown removes exactly those, `leftovers()` proves nothing remains, and a run that
crashed is cleaned up by the next one (its PID is gone).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent.parent
COMPOSE_FILES = [ROOT / "docker-compose.yml", ROOT / "tests" / "compose" / "override.yml"]
STANDIN_SCRIPT = ROOT / "tests" / "compose" / "standin-images.sh"
PROJECT_PREFIX = "ramdeck-test-"
PROJECT_LABEL = "com.docker.compose.project"
# Variables of the compose file that a developer's shell may hold; the test runs the file's own defaults.
_COMPOSE_VARIABLES = (
    "RAMDECK_SECRET_KEY",
    "RAMDECK_ENCRYPTION_KEYS",
    "RAMDECK_ADMIN_PASSWORD",
    "ALLOWED_HOSTS",
    "RAMDECK_BIND",
    "COMPOSE_FILE",
    "COMPOSE_PROJECT_NAME",
    "RAMDECK_DEMO_NODE_CONTEXT",
)


def compose_command() -> list[str] | None:
    """`docker-compose` (v1, Debian's package) or the `docker compose` plugin (v2), whichever works."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker") and _ok(["docker", "compose", "version"]):
        return ["docker", "compose"]
    return None


def unavailable_reason() -> str | None:
    """Why this machine cannot run the compose trial, or None when it can."""
    if shutil.which("docker") is None:
        return "the docker client is missing (make test installs docker.io)"
    if not _ok(["docker", "info"], timeout=30):
        return "no Docker engine answers (make test starts dockerd when it can)"
    if compose_command() is None:
        return "neither docker-compose nor the docker compose plugin is installed"
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        return "building the stand-in base images needs root and debootstrap"
    return None


def _ok(argv: Sequence[str], timeout: float = 60) -> bool:
    try:
        return subprocess.run(list(argv), capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


_LISTINGS = {"container": ["ps", "-a"], "volume": ["volume", "ls"], "network": ["network", "ls"]}
_NAME_FIELD = {"container": "{{.Names}}", "volume": "{{.Name}}", "network": "{{.Name}}"}


def _labelled(kind: str, project: str) -> list[str]:
    """Names of containers, volumes or networks carrying the project's compose label."""
    result = subprocess.run(
        [
            "docker",
            *_LISTINGS[kind],
            "--filter",
            f"label={PROJECT_LABEL}={project}",
            "--format",
            _NAME_FIELD[kind],
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return sorted(result.stdout.split())


DEMO_NODE_DIR = ROOT / "compose" / "demo-node"
# What the demo node needs of a llama.cpp build folder: the two programs and their shared libraries.
_PREBUILT = ("llama-server", "ggml-rpc-server", "*.so*")


def prepare_demo_node_context(bin_dir: Path, into: Path) -> Path:
    """A copy of the demo node's build context whose prebuilt/ holds the build in `bin_dir` (the suite's own,
    tests/llamacpp_build.py), so its image takes that one instead of compiling the pinned source again."""
    context = into / "demo-node"
    shutil.copytree(DEMO_NODE_DIR, context)
    for pattern in _PREBUILT:
        for path in bin_dir.glob(pattern):
            shutil.copy2(path, context / "prebuilt" / path.name, follow_symlinks=False)
    if not (context / "prebuilt" / "llama-server").exists():
        raise AssertionError(f"{bin_dir} holds no llama-server to put in the demo node's image")
    return context


def build_standin_images() -> None:
    subprocess.run(["bash", str(STANDIN_SCRIPT)], check=True, timeout=1800, cwd=ROOT)


class ComposeStack:
    """One compose project of the trial, published on `port` (loopback)."""

    def __init__(self, project: str, port: int, demo_node_context: Path | None = None) -> None:
        self.project = project
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = {k: v for k, v in os.environ.items() if k not in _COMPOSE_VARIABLES}
        self.env["RAMDECK_PORT"] = str(port)
        if demo_node_context is not None:
            self.env["RAMDECK_DEMO_NODE_CONTEXT"] = str(demo_node_context)

    def compose(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        command = compose_command()
        assert command is not None
        files = [part for path in COMPOSE_FILES for part in ("-f", str(path))]
        result = subprocess.run(
            [*command, "-p", self.project, *files, *args],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"compose {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
            )
        return result

    def build(self) -> None:
        self.compose("build", timeout=1800)

    def up(self) -> None:
        self.compose("up", "-d", timeout=600)

    def down(self) -> subprocess.CompletedProcess:
        return self.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=300, check=False)

    def leftovers(self) -> dict[str, list[str]]:
        return {kind: _labelled(kind, self.project) for kind in ("container", "volume", "network")}

    def logs(self, service: str) -> str:
        return self.compose("logs", "--no-color", service, timeout=60).stdout

    def exec(self, service: str, *argv: str, timeout: float = 120) -> str:
        return self.compose("exec", "-T", service, *argv, timeout=timeout).stdout

    def console_query(self, code: str) -> object:
        """Run Python in the web container with Django set up and return what it prints as JSON: a read of
        the compose stack's own database, which nothing outside the containers can reach."""
        output = self.exec("web", "python", "manage.py", "shell", "-c", code)
        return json.loads(output.strip().splitlines()[-1])

    def wait_until_served(self, path: str = "/login/", timeout: float = 240) -> float:
        """Seconds until `path` answers 200."""
        started = time.monotonic()
        last = ""
        while time.monotonic() - started < timeout:
            try:
                response = httpx.get(self.base_url + path, timeout=5)
                if response.status_code == 200:
                    return time.monotonic() - started
                last = f"HTTP {response.status_code}"
            except httpx.HTTPError as exc:
                last = str(exc) or type(exc).__name__
            time.sleep(0.5)
        log = self.logs("web")[-4000:]
        raise AssertionError(f"{path} was not served within {timeout:g} s ({last}):\n{log}")


def cleanup_crashed_projects() -> list[str]:
    """`down -v` the test projects whose test process is gone (a crashed or killed earlier run)."""
    projects: set[str] = set()
    label_format = f'{{{{.Label "{PROJECT_LABEL}"}}}}'
    for listing in _LISTINGS.values():
        result = subprocess.run(
            ["docker", *listing, "--filter", f"label={PROJECT_LABEL}", "--format", label_format],
            capture_output=True,
            text=True,
            timeout=60,
        )
        projects.update(result.stdout.split())
    removed = []
    for project in sorted(projects):
        match = re.fullmatch(rf"{re.escape(PROJECT_PREFIX)}(\d+)", project)
        if match and not Path(f"/proc/{match.group(1)}").exists():
            ComposeStack(project, 0).down()
            removed.append(project)
    return removed
