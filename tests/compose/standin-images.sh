#!/bin/bash
# Local stand-ins for the public base images docker-compose.yml names, for machines that reach Debian's
# package archive and PyPI but no image registry (the test machines):
#   local/debian:bookworm              debootstrap minbase of bookworm (for debian:bookworm-slim)
#   local/python:3.12-slim-bookworm    that + a CPython 3.12+ of this machine (scripts on PATH, host CA for pip)
#   local/postgres:16                  Debian's PostgreSQL 15, honouring POSTGRES_USER, POSTGRES_PASSWORD (or
#                                      POSTGRES_PASSWORD_FILE, read as root) and POSTGRES_DB like the official image
#   local/redis:7                      Debian's Redis 7.0 run as user redis (uid 999), a config file first,
#                                      protected mode off and /data, as in the official image
# tests/compose/override.yml points the compose services and build arguments at them.
# Needs root, a running dockerd and debootstrap. Idempotent: an image that exists is kept (FORCE=1 rebuilds),
# unless its recipe's revision (the label ramdeck.standin.revision, bumped with each change) is older.
#
# The CPython copied in: STANDIN_PYTHON (an install prefix), else the base installation of the project's
# virtualenv (sys.base_prefix: under pyenv, $PYENV_ROOT/versions/3.12.x), else PYENV_ROOT's newest 3.12+.
# Never $HOME: under CI the home folder is a fresh, empty one.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
revision() { docker image inspect -f '{{with .Config.Labels}}{{index . "ramdeck.standin.revision"}}{{end}}' "$1"; }
have() { [ -z "${FORCE:-}" ] && docker image inspect "$1" >/dev/null 2>&1 && [ "$(revision "$1")" = "${2:-}" ]; }
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

PG_REVISION=2  # 2: POSTGRES_PASSWORD_FILE
if ! have local/postgres:16 "$PG_REVISION"; then
  mkdir -p "$W/pg"
  cat > "$W/pg/entrypoint.sh" <<'SH'
#!/bin/sh
set -e
PGBIN=/usr/lib/postgresql/15/bin D=${PGDATA:-/var/lib/postgresql/data} U=${POSTGRES_USER:-postgres}
# As the official image: the password from a file, read while still root, exclusive with the variable.
if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
  [ -z "${POSTGRES_PASSWORD:-}" ] || { echo "error: both POSTGRES_PASSWORD and POSTGRES_PASSWORD_FILE are set" >&2; exit 1; }
  POSTGRES_PASSWORD=$(cat "$POSTGRES_PASSWORD_FILE")
fi
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
  cat > "$W/pg/Dockerfile" <<DOCKER
FROM local/debian:bookworm
LABEL ramdeck.standin.revision=$PG_REVISION
RUN apt-get update && apt-get install -y --no-install-recommends postgresql-15 && rm -rf /var/lib/apt/lists/*
ENV PATH=/usr/lib/postgresql/15/bin:\$PATH PGDATA=/var/lib/postgresql/data
COPY entrypoint.sh /entrypoint.sh
STOPSIGNAL SIGINT
ENTRYPOINT ["/entrypoint.sh"]
DOCKER
  docker build -q -t local/postgres:16 "$W/pg" >/dev/null
fi

REDIS_REVISION=2  # 2: user redis (uid 999), a config file as the first argument
if ! have local/redis:7 "$REDIS_REVISION"; then
  mkdir -p "$W/redis"
  cat > "$W/redis/entrypoint.sh" <<'SH'
#!/bin/sh
# As the official image: redis-server runs as the redis user, owning /data; a config file stays the
# first argument (redis-server reads it only there).
set -e
if [ "$1" = redis-server ]; then
  shift
  case "${1:-}" in
    *.conf) conf=$1; shift; set -- "$conf" --protected-mode no "$@" ;;
    *) set -- --protected-mode no "$@" ;;
  esac
  find /data \! -user redis -exec chown redis '{}' +
  exec setpriv --reuid=redis --regid=redis --init-groups /usr/bin/redis-server "$@"
fi
exec "$@"
SH
  chmod +x "$W/redis/entrypoint.sh"
  cat > "$W/redis/Dockerfile" <<DOCKER
FROM local/debian:bookworm
LABEL ramdeck.standin.revision=$REDIS_REVISION
# The official image's redis user and group (999), made before the package would make its own.
RUN groupadd -r -g 999 redis && useradd -r -g redis -u 999 -d /data -s /usr/sbin/nologin redis \\
    && apt-get update && apt-get install -y --no-install-recommends redis-server redis-tools \\
    && rm -rf /var/lib/apt/lists/* && mkdir -p /data && chown redis:redis /data
WORKDIR /data
COPY entrypoint.sh /entrypoint.sh
ENTRYPOINT ["/entrypoint.sh"]
CMD ["redis-server"]
DOCKER
  docker build -q -t local/redis:7 "$W/redis" >/dev/null
fi
docker images --format '{{.Repository}}:{{.Tag}}' | grep '^local/' | sort
