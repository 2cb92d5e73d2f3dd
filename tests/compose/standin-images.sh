#!/bin/bash
# Local stand-ins for the public base images docker-compose.yml names, for machines that reach Debian's
# package archive and PyPI but no image registry (the test machines):
#   local/debian:bookworm              debootstrap minbase of bookworm (for debian:bookworm-slim)
#   local/python:3.12-slim-bookworm    that + a CPython 3.12+ of this machine (scripts on PATH, host CA for pip)
#   local/postgres:16                  Debian's PostgreSQL 15, honouring POSTGRES_USER/PASSWORD/DB like the official image
#   local/redis:7                      Debian's Redis 7.0, protected mode off and /data as in the official image
# tests/compose/override.yml points the compose services and build arguments at them.
# Needs root, a running dockerd and debootstrap. Idempotent: an image that exists is kept (FORCE=1 rebuilds).
#
# The CPython copied in: STANDIN_PYTHON (an install prefix), else the base installation of the project's
# virtualenv (sys.base_prefix: under pyenv, $PYENV_ROOT/versions/3.12.x), else PYENV_ROOT's newest 3.12+.
# Never $HOME: under CI the home folder is a fresh, empty one.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
have() { [ -z "${FORCE:-}" ] && docker image inspect "$1" >/dev/null 2>&1; }
fail() { echo "standin-images: $*" >&2; exit 1; }

self_contained_python() {
  # A prefix with its own bin/python3 of version 3.12+, not the system's /usr (which cannot be copied).
  local prefix=$1
  [ -n "$prefix" ] && [ "$prefix" != /usr ] && [ "$prefix" != /usr/local ] && [ -x "$prefix/bin/python3" ] &&
    "$prefix/bin/python3" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null
}

find_python() {
  local candidate
  if [ -n "${STANDIN_PYTHON:-}" ]; then
    self_contained_python "$STANDIN_PYTHON" || fail "STANDIN_PYTHON=$STANDIN_PYTHON is not a CPython 3.12+ prefix"
    echo "$STANDIN_PYTHON"; return
  fi
  for candidate in "$ROOT/.venv/bin/python" python3.14 python3.13 python3.12 python3; do
    command -v "$candidate" >/dev/null 2>&1 || continue
    candidate=$("$candidate" -c 'import sys; print(sys.base_prefix)' 2>/dev/null) || continue
    if self_contained_python "$candidate"; then echo "$candidate"; return; fi
  done
  if [ -n "${PYENV_ROOT:-}" ]; then
    for candidate in $(ls -d "$PYENV_ROOT"/versions/3.* 2>/dev/null | sort -V -r); do
      if self_contained_python "$candidate"; then echo "$candidate"; return; fi
    done
  fi
  fail "no self-contained CPython 3.12+ found (set STANDIN_PYTHON to its install prefix)"
}

MIRROR=$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)
MIRROR=${MIRROR:-$(awk '/^deb /{print $2; exit}' /etc/apt/sources.list 2>/dev/null)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

if ! have local/debian:bookworm; then
  command -v debootstrap >/dev/null || fail "debootstrap is missing (apt-get install debootstrap)"
  debootstrap --variant=minbase bookworm "$W/rootfs" "$MIRROR" >/dev/null
  tar -C "$W/rootfs" -c . | docker import - local/debian:bookworm >/dev/null
  rm -rf "$W/rootfs"
fi

if ! have local/python:3.12-slim-bookworm; then
  PY=$(find_python)
  mkdir -p "$W/py/python"
  # The standard library and pip only, like the official image: no test suite, no static library, and
  # none of the host's extra site-packages.
  tar -C "$PY" -c --exclude='__pycache__' --exclude='./lib/python3.*/test' \
    --exclude='./lib/python3.*/config-*' --exclude='./lib/python3.*/site-packages/*' . | tar -C "$W/py/python" -x
  site=$(cd "$PY" && ls -d lib/python3.*/site-packages)
  cp -a "$PY/$site"/pip "$PY/$site"/pip-*.dist-info "$W/py/python/$site/"
  cp /etc/ssl/certs/ca-certificates.crt "$W/py/host-ca.crt"
  cat > "$W/py/Dockerfile" <<DOCKER
FROM local/debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 zlib1g libffi8 \
    libsqlite3-0 libbz2-1.0 liblzma5 libreadline8 libncursesw6 libuuid1 && rm -rf /var/lib/apt/lists/*
COPY host-ca.crt /etc/ssl/certs/ca-certificates.crt
COPY python $PY
ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt PATH=$PY/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN ln -s $PY/bin/python3 /usr/local/bin/python && ln -sf $PY/bin/python3 /usr/local/bin/python3 \
    && ln -s $PY/bin/pip3 /usr/local/bin/pip && python -c 'import ssl, sqlite3, ctypes'
DOCKER
  docker build -q -t local/python:3.12-slim-bookworm "$W/py" >/dev/null
fi

if ! have local/postgres:16; then
  mkdir -p "$W/pg"
  cat > "$W/pg/entrypoint.sh" <<'SH'
#!/bin/sh
set -e
PGBIN=/usr/lib/postgresql/15/bin D=${PGDATA:-/var/lib/postgresql/data} U=${POSTGRES_USER:-postgres}
mkdir -p "$D" /run/postgresql && chown -R postgres:postgres "$D" /run/postgresql && chmod 700 "$D"
if [ ! -s "$D/PG_VERSION" ]; then
  printf '%s\n' "$POSTGRES_PASSWORD" > /tmp/pw && chown postgres /tmp/pw
  su postgres -c "$PGBIN/initdb -D $D -U $U --pwfile=/tmp/pw --encoding=UTF8 --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256" >/dev/null && rm /tmp/pw
  echo "host all all 0.0.0.0/0 scram-sha-256" >> "$D/pg_hba.conf"
  su postgres -c "$PGBIN/pg_ctl -D $D -o '-c listen_addresses=' -w start" >/dev/null
  DB=${POSTGRES_DB:-$U}
  if [ "$DB" != postgres ]; then
    su postgres -c "$PGBIN/psql -v ON_ERROR_STOP=1 -h /run/postgresql -U $U -d postgres -c 'CREATE DATABASE \"$DB\"'" >/dev/null
  fi
  su postgres -c "$PGBIN/pg_ctl -D $D -m fast -w stop" >/dev/null
fi
# setpriv execs (su would stay as PID 1 between docker's stop signal and the server).
exec setpriv --reuid=postgres --regid=postgres --init-groups "$PGBIN/postgres" -D "$D" -c 'listen_addresses=*'

SH
  chmod +x "$W/pg/entrypoint.sh"
  cat > "$W/pg/Dockerfile" <<'DOCKER'
FROM local/debian:bookworm
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-15 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
COPY entrypoint.sh /entrypoint.sh
STOPSIGNAL SIGINT
ENTRYPOINT ["/entrypoint.sh"]
DOCKER
  docker build -q -t local/postgres:16 "$W/pg" >/dev/null
fi

if ! have local/redis:7; then
  mkdir -p "$W/redis"
  printf '#!/bin/sh\nif [ "$1" = redis-server ]; then shift; exec /usr/bin/redis-server --protected-mode no "$@"; fi\nexec "$@"\n' > "$W/redis/entrypoint.sh"
  chmod +x "$W/redis/entrypoint.sh"
  printf 'FROM local/debian:bookworm\nRUN apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools && rm -rf /var/lib/apt/lists/* && mkdir -p /data\nWORKDIR /data\nCOPY entrypoint.sh /entrypoint.sh\nENTRYPOINT ["/entrypoint.sh"]\nCMD ["redis-server"]\n' > "$W/redis/Dockerfile"
  docker build -q -t local/redis:7 "$W/redis" >/dev/null
fi
docker images --format '{{.Repository}}:{{.Tag}}' | grep '^local/' | sort
