"""RAMDeck settings: one file, configured from the environment.

Every value that differs between a laptop trial and a production install comes from an environment
variable read through the small typed helpers below. A bad value stops the process at start-up with
ImproperlyConfigured naming the variable, rather than surfacing later as a confusing runtime error.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import tempfile
from datetime import timedelta
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP

# The planner's default share of unified memory: a constant of a pure-Python module (no Django, no imports),
# imported here so the setting and the planner cannot disagree about it.
from planning.unified_memory import DEFAULT_UNIFIED_CLAMP

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(os.environ.get("RAMDECK_VAR_DIR", BASE_DIR / "var"))
# What RAMDeck fetches or builds once per user (the pinned llama.cpp source, the tests' llama.cpp build):
# $XDG_CACHE_HOME/ramdeck, else ~/.cache/ramdeck, as the XDG base directory spec says.
RAMDECK_CACHE_DIR = Path(
    os.environ.get("RAMDECK_CACHE_DIR")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ramdeck"
)


# ---------------------------------------------------------------------------------------------------
# Environment helpers
# ---------------------------------------------------------------------------------------------------

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_str(name: str, default: str | None = None) -> str:
    value = os.environ.get(name, default)
    if value is None:
        raise ImproperlyConfigured(f"Set the environment variable {name}.")
    return value


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    lowered = raw.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ImproperlyConfigured(f"{name} must be a boolean (1/0, true/false, yes/no), not {raw!r}.")


def env_int(name: str, default: int, *, minimum: int | None = None, maximum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a whole number, not {raw!r}.") from exc
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ImproperlyConfigured(f"{name} must be between {minimum} and {maximum}, not {value}.")
    return value


def env_float(name: str, default: float, *, minimum: float, maximum: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be a number, not {raw!r}.") from exc
    if not minimum <= value <= maximum:
        raise ImproperlyConfigured(f"{name} must be between {minimum} and {maximum}, not {value}.")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def _persisted_dev_secret(filename: str, make) -> str:
    """A secret kept in var/ so a local trial survives restarts; production must set the variable.

    The web server, the worker and beat may start at the same moment on one fresh volume (docker compose):
    the value is written to a private temporary file and linked into place, which fails when another
    process got there first, so every process ends up with the one value that won and none reads half a file.
    """
    path = VAR_DIR / filename
    if not path.exists():
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=VAR_DIR, prefix=f".{filename}-")
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(make() + "\n")
            with contextlib.suppress(FileExistsError):
                os.link(temporary, path)
        finally:
            os.unlink(temporary)
    return path.read_text().strip()


# Values that were once published as defaults (the first docker-compose.yml, in this repository's history):
# anyone can read them, so a console that uses one has no secret at all. Start-up stops instead.
PUBLISHED_SECRETS = {
    "RAMDECK_SECRET_KEY": {"compose-trial-secret-key-change-me-0123456789abcdefghij"},
    "RAMDECK_ENCRYPTION_KEYS": {"6V2N8wqvJp1gU7hFJk3Oaf7m0m7B0hHf6mRz8bX7kGQ="},
    "RAMDECK_ADMIN_PASSWORD": {"change-me-now"},
}


def refuse_published_secret(name: str, values: str | list[str]) -> None:
    """Stop with ImproperlyConfigured when `name` holds a value known from a published file."""
    for value in [values] if isinstance(values, str) else values:
        if value.strip() in PUBLISHED_SECRETS[name]:
            raise ImproperlyConfigured(
                f"{name} is set to a value published in RAMDeck's repository (an old docker-compose.yml "
                "default), so it protects nothing. Unset it to have a random one generated on first start, "
                "or set your own random value."
            )


def env_secret(name: str) -> str | None:
    """A secret from the environment; unset and empty (compose passes `${NAME:-}`) both mean "none given"."""
    return os.environ.get(name, "").strip() or None


def env_secret_file(name: str) -> str | None:
    """The secret in the file that `name` names (docker-compose.yml's generated passwords), or None when
    `name` is unset or empty. A file that cannot be read or is empty stops the start, naming both."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = Path(raw).read_text().strip()
    except OSError as exc:
        raise ImproperlyConfigured(f"{name} names {raw}, which cannot be read: {exc.strerror}.") from exc
    if not value:
        raise ImproperlyConfigured(f"{name} names {raw}, which is empty.")
    return value


def url_with_password(url: str, password: str, *, url_name: str, file_name: str) -> str:
    """`url` with `password` put into it (quoted), refusing a URL that already carries one: two sources for
    one password would leave it unclear which one is in use."""
    parsed = urlsplit(url)
    if parsed.password is not None:
        raise ImproperlyConfigured(
            f"{url_name} carries a password and {file_name} names a file with another: use one of them."
        )
    user, _, host = parsed.netloc.rpartition("@")
    return urlunsplit(parsed._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


# ---------------------------------------------------------------------------------------------------
# Core
# ---------------------------------------------------------------------------------------------------

DEBUG = env_bool("DEBUG", default=False)

if env_secret("RAMDECK_SECRET_KEY"):
    SECRET_KEY = env_str("RAMDECK_SECRET_KEY").strip()
elif DEBUG or env_bool("RAMDECK_LOCAL_TRIAL", default=True):
    SECRET_KEY = _persisted_dev_secret("secret_key", lambda: secrets.token_urlsafe(50))
else:
    raise ImproperlyConfigured("Set RAMDECK_SECRET_KEY (a long random string) in production.")

ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "daphne",
    "ramdeck_site.admin_site.RamdeckAdminConfig",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "channels",
    "django_htmx",
    "axes",
    # The console's apps, bottom of the import order first (docs/architecture.md).
    "ramdeck_site",
    "audit",
    "jobs",
    "nodes",
    "builds",
    "calibration",
    "modelfiles",
    "deployments",
    "chat",
    "console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Content-Security-Policy (SECURE_CSP below) with a fresh nonce per response.
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.auth.middleware.LoginRequiredMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Axes must come last so it sees the outcome of authentication.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "ramdeck_site.urls"
ASGI_APPLICATION = "ramdeck_site.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                # {{ csp_nonce }}: the only inline <script>/<style> a page may have carries it.
                "django.template.context_processors.csp",
                "ramdeck_site.roles.role_context",
            ],
        },
    },
]

# ---------------------------------------------------------------------------------------------------
# Database: SQLite in var/ by default, anything dj-database-url understands through DATABASE_URL
# ---------------------------------------------------------------------------------------------------

DATABASES = {
    "default": dj_database_url.parse(
        os.environ.get("DATABASE_URL") or f"sqlite:///{VAR_DIR / 'ramdeck.sqlite3'}",
        conn_max_age=env_int("DATABASE_CONN_MAX_AGE", 0, minimum=0),
    )
}
# The password from a file instead of the URL: docker-compose.yml generates it on first start.
if _database_password := env_secret_file("DATABASE_PASSWORD_FILE"):
    if DATABASES["default"].get("PASSWORD"):
        raise ImproperlyConfigured(
            "DATABASE_URL carries a password and DATABASE_PASSWORD_FILE names a file with another: "
            "use one of them."
        )
    DATABASES["default"]["PASSWORD"] = _database_password
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # WAL and a busy timeout let the web server, the Celery worker and beat share one file.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
    }
    # A file (not memory) so live-server and worker processes started by tests share the test database;
    # the PID keeps concurrent test runs apart.
    DATABASES["default"]["TEST"] = {"NAME": str(VAR_DIR / f"test-{os.getpid()}.sqlite3")}
elif DATABASES["default"].get("NAME"):
    # Two test runs against one server (an engineer's beside CI's) must not create, truncate and drop the same
    # test database under each other: the PID keeps them apart here too. Processes a test starts are given
    # the test database's own name (tests/job_fixtures.py `database_url`).
    DATABASES["default"]["TEST"] = {"NAME": f"test_{DATABASES['default']['NAME']}_{os.getpid()}"}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# ---------------------------------------------------------------------------------------------------
# Redis: channel layer, Celery broker and results
# ---------------------------------------------------------------------------------------------------

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
# The password from a file instead of the URL: docker-compose.yml generates it on first start.
if _redis_password := env_secret_file("REDIS_PASSWORD_FILE"):
    REDIS_URL = url_with_password(
        REDIS_URL, _redis_password, url_name="REDIS_URL", file_name="REDIS_PASSWORD_FILE"
    )

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "capacity": 5000, "expiry": 60},
    }
}

CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
# Long jobs (builds take minutes): acknowledge after the run so a dead worker's task is redelivered,
# take one task at a time, and keep both time limits below the broker's visibility timeout so Redis
# never hands a still-running task to a second worker.
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# The runner stops a job at its kind's time limit, or this one (jobs/runner.py); Celery's own limits are
# only a backstop for a runner that cannot.
RAMDECK_JOB_TIME_LIMIT_S = env_int("RAMDECK_JOB_SOFT_TIME_LIMIT", 3 * 3600, minimum=60)
CELERY_TASK_SOFT_TIME_LIMIT = RAMDECK_JOB_TIME_LIMIT_S + 300
CELERY_TASK_TIME_LIMIT = CELERY_TASK_SOFT_TIME_LIMIT + 300
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": CELERY_TASK_TIME_LIMIT + 1800}
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", default=False)
CELERY_BEAT_SCHEDULE: dict = {}  # Filled by ramdeck_site/celery.py from the intervals below.
# Two queues, each with its own worker: Celery's default queue for long work (builds, downloads,
# deployments, commands) and this one for control work that must never wait behind it (stop, reap,
# probe, the monitor and the sweeper). jobs/kinds.py says which kind goes where.
CELERY_TASK_DEFAULT_QUEUE = env_str("RAMDECK_WORK_QUEUE", "celery")
RAMDECK_CONTROL_QUEUE = env_str("RAMDECK_CONTROL_QUEUE", "control")
CELERY_TASK_ROUTES = {
    name: {"queue": RAMDECK_CONTROL_QUEUE}
    for name in (
        "jobs.tasks.sweep_lost_jobs",
        "nodes.tasks.probe_all_nodes",
        "deployments.tasks.check_deployments",
        "deployments.tasks.scan_stale",
    )
}
# A queued job whose task message is in no queue after this long is sent again (jobs/sweeper.py); one
# still queued after the second figure is errored as never started.
RAMDECK_QUEUED_RESEND_AFTER_S = env_int("RAMDECK_QUEUED_RESEND_AFTER_S", 120, minimum=5)
RAMDECK_QUEUED_GIVE_UP_S = env_int("RAMDECK_QUEUED_GIVE_UP_S", 24 * 3600, minimum=60)
# A job keeps at most this many log lines: the first and the last half, the cut marked (0: no cap).
RAMDECK_JOB_LOG_MAX_LINES = env_int("RAMDECK_JOB_LOG_MAX_LINES", 500_000, minimum=0)
# How long a running job waits for the database to come back (a PostgreSQL restart) before it gives up.
RAMDECK_DATABASE_OUTAGE_S = env_int("RAMDECK_DATABASE_OUTAGE_S", 120, minimum=0)

RAMDECK_PROBE_INTERVAL_S = env_int("RAMDECK_PROBE_INTERVAL_S", 300, minimum=0)
# An offline node is looked at less often the longer it stays away: the wait doubles up to this.
RAMDECK_PROBE_BACKOFF_MAX_S = env_int("RAMDECK_PROBE_BACKOFF_MAX_S", 3600, minimum=0)
RAMDECK_SWEEP_INTERVAL_S = env_int("RAMDECK_SWEEP_INTERVAL_S", 60, minimum=10)

# ---------------------------------------------------------------------------------------------------
# Authentication, roles and lockout
# ---------------------------------------------------------------------------------------------------

AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "dashboard"
LOGOUT_REDIRECT_URL = "login"

# Two limits on failed logins within the cool-off (ramdeck_site/lockout.py): this many from one address lock
# that address, whatever usernames it tries; RAMDECK_LOGIN_ACCOUNT_FAILURE_LIMIT against one account, from
# any addresses, lock that account. A locked address adds no more failures to anyone's count, so with the
# defaults it takes four addresses to lock an account. An admin unlocks an account on the Users page, or on
# the console's host with `manage.py axes_reset_username NAME` (`axes_reset_ip ADDRESS` for an address).
AXES_FAILURE_LIMIT = env_int("RAMDECK_LOGIN_FAILURE_LIMIT", 5, minimum=1)
RAMDECK_LOGIN_ACCOUNT_FAILURE_LIMIT = env_int("RAMDECK_LOGIN_ACCOUNT_FAILURE_LIMIT", 20, minimum=1)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("RAMDECK_LOGIN_COOLOFF_MINUTES", 15, minimum=1))
AXES_LOCKOUT_PARAMETERS = ["ip_address", "username"]
AXES_HANDLER = "ramdeck_site.lockout.LockoutHandler"
# Failures while locked out are refused without being counted: a lock ends one cool-off after the failures
# that caused it, and a locked address cannot go on adding to an account's count.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_RESET_ON_SUCCESS = True
# The client's address as the audit history sees it (behind RAMDECK_TRUSTED_PROXIES, from X-Forwarded-For).
AXES_CLIENT_IP_CALLABLE = "audit.history.client_ip"
# What axes stores as the username: an unknown one (perhaps a password typed into the wrong box) as a keyed
# hash, never as typed.
AXES_USERNAME_CALLABLE = "ramdeck_site.lockout.username_for_lockout"
AXES_LOCKOUT_TEMPLATE = "registration/locked_out.html"
AXES_VERBOSE = False

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

# ---------------------------------------------------------------------------------------------------
# Secrets at rest: MultiFernet keys, newest first. `manage.py rotate_encryption_key` re-encrypts.
# ---------------------------------------------------------------------------------------------------

if env_secret("RAMDECK_ENCRYPTION_KEYS"):
    RAMDECK_ENCRYPTION_KEYS = env_list("RAMDECK_ENCRYPTION_KEYS", [])
elif DEBUG or env_bool("RAMDECK_LOCAL_TRIAL", default=True):
    from cryptography.fernet import Fernet

    RAMDECK_ENCRYPTION_KEYS = [
        _persisted_dev_secret("encryption_key", lambda: Fernet.generate_key().decode())
    ]
else:
    raise ImproperlyConfigured("Set RAMDECK_ENCRYPTION_KEYS (comma-separated Fernet keys) in production.")

# Whichever way they were set (environment or a var/ file), none may be a published value; the admin
# password is only read by `manage.py ensure_admin`, but a published one in the environment stops every start.
refuse_published_secret("RAMDECK_SECRET_KEY", SECRET_KEY)
refuse_published_secret("RAMDECK_ENCRYPTION_KEYS", RAMDECK_ENCRYPTION_KEYS)
refuse_published_secret("RAMDECK_ADMIN_PASSWORD", os.environ.get("RAMDECK_ADMIN_PASSWORD", ""))

# ---------------------------------------------------------------------------------------------------
# Remote execution and llama.cpp
# ---------------------------------------------------------------------------------------------------

RAMDECK_SSH_CONNECT_TIMEOUT_S = env_float("RAMDECK_SSH_CONNECT_TIMEOUT_S", 10.0, minimum=0.5, maximum=300)
RAMDECK_SSH_KEEPALIVE_S = env_float("RAMDECK_SSH_KEEPALIVE_S", 15.0, minimum=1, maximum=600)
RAMDECK_COMMAND_TIMEOUT_S = env_float("RAMDECK_COMMAND_TIMEOUT_S", 3 * 3600, minimum=1, maximum=86400)
RAMDECK_KILL_GRACE_S = env_float("RAMDECK_KILL_GRACE_S", 5.0, minimum=0.1, maximum=120)
RAMDECK_MAX_UPLOAD_BYTES = env_int("RAMDECK_MAX_UPLOAD_BYTES", 64 * 1024, minimum=1024)
# What one command on a node may leave in the console: bytes of output kept (in its job log, or for parsing)
# before the rest is dropped with a note; a node that prints without end cannot fill memory or the database.
RAMDECK_COMMAND_OUTPUT_MAX_BYTES = env_int("RAMDECK_COMMAND_OUTPUT_MAX_BYTES", 16 * 2**20, minimum=65536)
# This console's id in what it leaves on nodes (the comment of a tunnel key in a worker's authorized_keys),
# so two consoles that manage one node tell their entries apart. Generated once into var/ unless set.
RAMDECK_CONSOLE_ID = os.environ.get("RAMDECK_CONSOLE_ID", "").strip() or _persisted_dev_secret(
    "console_id", lambda: secrets.token_hex(4)
)
if not (
    len(RAMDECK_CONSOLE_ID) <= 32
    and RAMDECK_CONSOLE_ID.isascii()
    and RAMDECK_CONSOLE_ID.replace("-", "").isalnum()
):
    raise ImproperlyConfigured(
        f"RAMDECK_CONSOLE_ID must be 1 to 32 letters, digits or dashes, not {RAMDECK_CONSOLE_ID!r}."
    )
# The share of Apple unified memory a plan may use unless the plan form says otherwise (its default).
RAMDECK_UNIFIED_MEMORY_CLAMP = env_float(
    "RAMDECK_UNIFIED_MEMORY_CLAMP", DEFAULT_UNIFIED_CLAMP, minimum=0.1, maximum=1.0
)
# A calibration older than this is marked stale on the node page (the planner still uses it, with a warning).
RAMDECK_CALIBRATION_MAX_AGE_DAYS = env_float(
    "RAMDECK_CALIBRATION_MAX_AGE_DAYS", 30.0, minimum=0, maximum=3650
)
RAMDECK_LLAMACPP_GIT_URL = env_str("RAMDECK_LLAMACPP_GIT_URL", "https://github.com/ggml-org/llama.cpp.git")
RAMDECK_LLAMACPP_GIT_REF = env_str("RAMDECK_LLAMACPP_GIT_REF", "b6800")
RAMDECK_BUILD_ROOT = env_str("RAMDECK_BUILD_ROOT", "~/.ramdeck/llama.cpp")
# The only folder on the console host whose tarballs a build may upload to a node (no other file leaves).
# The pinned llama.cpp source (llamacpp/source.py) is fetched into it on first use.
RAMDECK_TARBALL_DIR = os.path.expanduser(env_str("RAMDECK_TARBALL_DIR", str(RAMDECK_CACHE_DIR / "tarballs")))
# Folders of the console's own host where models live: a download onto a Local-transport node goes into the
# first, and registering a file there by path accepts only files under one of them (os.pathsep-separated).
RAMDECK_MODEL_DIRS = [
    os.path.abspath(os.path.expanduser(item))
    for item in env_str("RAMDECK_MODEL_DIRS", str(VAR_DIR / "models")).split(os.pathsep)
    if item.strip()
]
# Where the small real model to try (llamacpp/real_model.py) is put on a remote node (~ is that node's home).
RAMDECK_NODE_MODEL_DIR = env_str("RAMDECK_NODE_MODEL_DIR", "~/.ramdeck/models")
# Downloads on the console's own host never fetch from loopback, link-local, private or other non-public
# addresses (its router, its metadata service, its own Redis) unless an admin lists the networks here
# (comma-separated CIDRs, e.g. 192.168.1.0/24 for a NAS on the LAN). Redirects: at most this many.
RAMDECK_DOWNLOAD_ALLOW_NETWORKS = env_list("RAMDECK_DOWNLOAD_ALLOW_NETWORKS", [])
RAMDECK_DOWNLOAD_MAX_REDIRECTS = env_int("RAMDECK_DOWNLOAD_MAX_REDIRECTS", 5, minimum=0, maximum=20)
# The largest file a download may write, on any node. Hugging Face holds at most 50 GB per file (larger models
# come in shards), so the default leaves room for hosts that do not split, and stops a server that streams
# without end from filling the node's disk.
RAMDECK_DOWNLOAD_MAX_BYTES = env_int("RAMDECK_DOWNLOAD_MAX_BYTES", 256 * 2**30, minimum=2**20)
# The tarball the build form offers first: a file name in RAMDECK_TARBALL_DIR (default: the pinned source).
RAMDECK_LLAMACPP_TARBALL = env_str("RAMDECK_LLAMACPP_TARBALL", "")
# When llama.cpp's logged placement differs from the plan: "fail" the deployment or only "warn".
RAMDECK_PLACEMENT_MISMATCH = env_str("RAMDECK_PLACEMENT_MISMATCH", "fail")
if RAMDECK_PLACEMENT_MISMATCH not in ("fail", "warn"):
    raise ImproperlyConfigured("RAMDECK_PLACEMENT_MISMATCH must be fail or warn.")
# llama-server's /health wait: a minute plus this much per GiB of model.
RAMDECK_HEALTH_TIMEOUT_PER_GIB_S = env_float(
    "RAMDECK_HEALTH_TIMEOUT_PER_GIB_S", 30.0, minimum=1, maximum=3600
)
# The console's chat with a running deployment: at most this many tokens per answer (a model that never
# stops, or a random-weights test model, would otherwise write until its context is full).
RAMDECK_CHAT_MAX_TOKENS = env_int("RAMDECK_CHAT_MAX_TOKENS", 2048, minimum=1, maximum=1_000_000)
# The chat's sampling temperature (0: greedy, the same answer every time); unset: llama-server's default.
RAMDECK_CHAT_TEMPERATURE = (
    env_float("RAMDECK_CHAT_TEMPERATURE", 0.0, minimum=0.0, maximum=5.0)
    if os.environ.get("RAMDECK_CHAT_TEMPERATURE", "").strip()
    else None
)
# How often beat checks that running deployments' processes are alive (0: never).
RAMDECK_DEPLOYMENT_CHECK_INTERVAL_S = env_int("RAMDECK_DEPLOYMENT_CHECK_INTERVAL_S", 60, minimum=0)
if RAMDECK_DEPLOYMENT_CHECK_INTERVAL_S:
    CELERY_BEAT_SCHEDULE["check-deployments"] = {
        "task": "deployments.tasks.check_deployments",
        "schedule": float(RAMDECK_DEPLOYMENT_CHECK_INTERVAL_S),
    }
# Self-healing (a deployment opts in): attempts per degraded spell; the first wait between them (doubles).
RAMDECK_SELF_HEAL_ATTEMPTS = env_int("RAMDECK_SELF_HEAL_ATTEMPTS", 3, minimum=1)
RAMDECK_SELF_HEAL_BACKOFF_S = env_int("RAMDECK_SELF_HEAL_BACKOFF_S", 60, minimum=0)
# How often beat looks for stale rpc-servers/llama-servers of ours on every node (0: never).
RAMDECK_STALE_SCAN_INTERVAL_S = env_int("RAMDECK_STALE_SCAN_INTERVAL_S", 300, minimum=0)
if RAMDECK_STALE_SCAN_INTERVAL_S:
    CELERY_BEAT_SCHEDULE["scan-stale-processes"] = {
        "task": "deployments.tasks.scan_stale",
        "schedule": float(RAMDECK_STALE_SCAN_INTERVAL_S),
    }

# ---------------------------------------------------------------------------------------------------
# Static files, sessions, security
# ---------------------------------------------------------------------------------------------------

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = VAR_DIR / "staticfiles"
STATIC_ROOT.mkdir(parents=True, exist_ok=True)  # WhiteNoise warns on every request without it.
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    # Compressed but not hashed: pages work before collectstatic has run (tests, first start).
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedStaticFilesStorage"},
}
# Serve straight from the app and project static folders too, so a missing collectstatic never breaks the UI.
WHITENOISE_USE_FINDERS = True

SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_AGE = env_int("RAMDECK_SESSION_AGE_S", 12 * 3600, minimum=300)
CSRF_COOKIE_HTTPONLY = False  # htmx reads the token from the page, not the cookie; keep Django's default.
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
# Content-Security-Policy: scripts and style sheets only from the console itself or carrying the response's
# nonce; no eval (htmx runs with allowEval false, see base.html); no plugins, frames, foreign forms or
# <base>. `style` attributes stay allowed (the bars' widths): they set layout, they cannot run script.
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF, CSP.NONCE],
    "style-src": [CSP.SELF, CSP.NONCE],
    "style-src-attr": [CSP.UNSAFE_INLINE],
    "img-src": [CSP.SELF, "data:"],
    "connect-src": [CSP.SELF],
    "object-src": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "frame-ancestors": [CSP.NONE],
    "form-action": [CSP.SELF],
}
SECURE_REFERRER_POLICY = "same-origin"

# Behind TLS (a reverse proxy or a certificate of its own), RAMDECK_HTTPS=1 turns on every HTTPS-only
# protection. Many household consoles run on plain HTTP inside the LAN; for them these checks cannot
# pass, and we silence exactly those checks, for exactly that reason, rather than pretend.
RAMDECK_HTTPS = env_bool("RAMDECK_HTTPS", default=False)
SESSION_COOKIE_SECURE = RAMDECK_HTTPS
CSRF_COOKIE_SECURE = RAMDECK_HTTPS
SECURE_SSL_REDIRECT = RAMDECK_HTTPS and env_bool("RAMDECK_SSL_REDIRECT", default=True)
SECURE_HSTS_SECONDS = env_int("RAMDECK_HSTS_SECONDS", 31536000 if RAMDECK_HTTPS else 0, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = RAMDECK_HTTPS
SECURE_HSTS_PRELOAD = False
RAMDECK_TRUST_PROXY_HEADER = env_bool("RAMDECK_TRUST_PROXY_HEADER", default=False)
if RAMDECK_TRUST_PROXY_HEADER:
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")


def env_networks(name: str, default: list[str]) -> list[str]:
    """Comma-separated addresses or CIDRs, each checked: a typo must not silently trust nobody, or all."""

    networks = []
    for item in env_list(name, default):
        try:
            networks.append(str(ipaddress.ip_network(item, strict=False)))
        except ValueError as exc:
            raise ImproperlyConfigured(f"{name}: {item!r} is not an IP address or network ({exc}).") from exc
    return networks


# The reverse proxies in front of the console (addresses or CIDRs). Only a request that comes from one of them
# has its client's address read from X-Forwarded-For (audit/history.py `client_ip`, which the login lockout
# uses too); from anyone else the header is ignored. Behind the README's proxy (RAMDECK_TRUST_PROXY_HEADER=1,
# the console on loopback, the proxy its only way in) that proxy is this machine, so loopback is the default;
# without it nobody is trusted. Otherwise every login would come from the proxy's address, and one
# guesser's lockout would lock everybody out.
RAMDECK_TRUSTED_PROXIES = env_networks(
    "RAMDECK_TRUSTED_PROXIES", ["127.0.0.1", "::1"] if RAMDECK_TRUST_PROXY_HEADER else []
)
SILENCED_SYSTEM_CHECKS = [
    # HSTS preload is a public-internet commitment that a LAN console must not make for its owner.
    "security.W021",
]
if not RAMDECK_HTTPS:
    SILENCED_SYSTEM_CHECKS += [
        "security.W004",  # HSTS: meaningless without TLS (set RAMDECK_HTTPS=1 behind TLS).
        "security.W008",  # SSL redirect: there is no HTTPS endpoint to redirect to.
        "security.W012",  # Secure session cookie: it would never be sent over plain HTTP.
        "security.W016",  # Secure CSRF cookie: likewise.
    ]

LANGUAGE_CODE = "en-gb"
TIME_ZONE = env_str("TIME_ZONE", "UTC")
USE_I18N = False
USE_TZ = True

DATA_UPLOAD_MAX_MEMORY_SIZE = 2 * 1024 * 1024

# ---------------------------------------------------------------------------------------------------
# Logging: one line per event to stderr; secrets never reach it because nothing logs them.
# ---------------------------------------------------------------------------------------------------

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    # A 500 is logged once, with its traceback and the reference its page shows (ramdeck_site/errors.py).
    "filters": {"skip_logged_server_errors": {"()": "ramdeck_site.errors.SkipLoggedServerErrors"}},
    "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["stderr"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.request": {"filters": ["skip_logged_server_errors"]},
        "asyncssh": {"level": "WARNING"},
        "daphne": {"level": "WARNING"},
        "django.channels.server": {"level": "WARNING"},
    },
}
