"""A PostgreSQL server of a test's own (never the machine's), which the test may stop and start again.

initdb and the server refuse to run as root, so under root they run as the `postgres` system user that
Debian's package creates. The cluster lives in a temporary folder with its socket; it listens on 127.0.0.1
on a free port and trusts local connections (a throwaway cluster, nothing else can reach it).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ramdeck_site.services import free_port
from tests.unavailable import unavailable

ENV = "RAMDECK_TEST_PRIVATE_POSTGRES"


def _bin_dir() -> Path | None:
    on_path = shutil.which("pg_ctl")
    if on_path:
        return Path(on_path).parent
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class PrivatePostgres:
    def __init__(self, bin_dir: Path, folder: Path, port: int) -> None:
        self.bin_dir = Path(bin_dir)
        self.folder = Path(folder)
        self.port = port

    @property
    def data(self) -> Path:
        return self.folder / "data"

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/ramdeck"

    @classmethod
    def create(cls) -> PrivatePostgres:
        bin_dir = _bin_dir()
        if bin_dir is None:
            unavailable("PostgreSQL's server programs (initdb, pg_ctl) are not installed")
        if os.geteuid() == 0 and shutil.which("runuser") is None:
            unavailable("runuser is needed to run PostgreSQL as the postgres user")
        folder = Path(tempfile.mkdtemp(prefix="ramdeck-pg-"))
        folder.chmod(0o755)
        if os.geteuid() == 0:
            shutil.chown(folder, "postgres", "postgres")
        server = cls(bin_dir, folder, free_port())
        server._run("initdb", "-D", str(server.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        return server

    @classmethod
    def from_environment(cls) -> PrivatePostgres:
        """The server a parent test started and described in the environment."""
        described = json.loads(os.environ[ENV])
        return cls(Path(described["bin_dir"]), Path(described["folder"]), int(described["port"]))

    def environment(self) -> dict[str, str]:
        described = {"bin_dir": str(self.bin_dir), "folder": str(self.folder), "port": self.port}
        return {ENV: json.dumps(described), "DATABASE_URL": self.url}

    def _run(self, program: str, *args: str) -> str:
        argv = [str(self.bin_dir / program), *args]
        if os.geteuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=self.folder, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{program} failed ({done.returncode}): {done.stdout}{done.stderr}")
        return done.stdout

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        log = str(self.folder / "server.log")
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", log, "-w", "start")

    def stop(self, mode: str = "fast") -> None:
        """`fast` ends every session at once, as a restart does; the clients see their connections die."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def remove(self) -> None:
        if self.running():
            self.stop("immediate")
        shutil.rmtree(self.folder, ignore_errors=True)
