"""The compose trial's database and broker passwords, generated on its first start.

docker-compose.yml runs this once per `up`, as its `secrets` service, before PostgreSQL and Redis start:

    python -m ramdeck_site.compose_secrets /run/ramdeck-secrets

into the `service-secrets` volume, which only PostgreSQL, Redis and the console's services mount:

- `postgres_password`: PostgreSQL's image sets it on its first start (POSTGRES_PASSWORD_FILE); the console
  reads it (DATABASE_PASSWORD_FILE).
- `redis_password`: the console reads it (REDIS_PASSWORD_FILE), as does Redis's health check.
- `redis.conf`: `requirepass` with that password, the config file redis-server starts with. The official
  image runs redis-server as its `redis` user (uid 999), so this one file belongs to that user; the others
  are root's, mode 0600 (PostgreSQL's entrypoint reads its file as root before it drops to `postgres`).

A password that exists is kept: PostgreSQL's is only applied when its data folder is created, so a new one
would lock the console out of its own database. Plain Python, no Django: the settings would generate the
console's own keys, which this service has no business holding.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from ramdeck_site.services import generated_secret

# The official redis image's `redis` user, fixed there since its first release.
REDIS_UID = 999


def write_redis_config(folder: Path, password: str, uid: int | None) -> Path:
    """`requirepass` for redis-server, rewritten on every run (so it always matches `redis_password`) and
    replaced in one rename: a Redis restarting meanwhile reads the old file or the new, never half of one."""
    path = folder / "redis.conf"
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=".redis.conf-")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(f"requirepass {password}\n")
            if uid is not None:
                os.fchown(handle.fileno(), uid, uid)
            os.fchmod(handle.fileno(), 0o400)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def ensure(folder: Path, redis_uid: int | None = REDIS_UID) -> None:
    if not folder.is_dir():
        raise SystemExit(f"compose_secrets: {folder} is not a folder (the service-secrets volume's mount).")
    for name in ("postgres_password", "redis_password"):
        path = folder / name
        if path.exists() and not path.read_text().strip():
            # Never written by us (we link complete files into place): someone emptied it. Stop rather than
            # start PostgreSQL or Redis with an empty password.
            raise SystemExit(f"compose_secrets: {path} is empty; remove it to have a new one generated.")
    generated_secret(folder / "postgres_password")
    write_redis_config(folder, generated_secret(folder / "redis_password"), redis_uid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--redis-uid",
        type=int,
        default=REDIS_UID,
        help=f"redis.conf's owner, redis-server's user (default {REDIS_UID}, as in the official image)",
    )
    args = parser.parse_args(argv)
    # Only root may give a file away; anyone else (a test) keeps it as their own.
    ensure(args.folder, args.redis_uid if os.geteuid() == 0 else None)
    print(f"compose_secrets: passwords in {args.folder} are ready.", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
