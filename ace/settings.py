"""ACE settings: everything comes from environment variables with safe embedded defaults.

See README.md ("Configuration") for the list. A bad value raises ace.env.ConfigError naming the variable.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
from datetime import timedelta
from pathlib import Path

import dj_database_url

from ace.env import (
    ConfigError,
    env_bool,
    env_choice,
    env_duration,
    env_float,
    env_int,
    env_networks,
    env_paths,
    env_str,
    env_url,
)
from ace.logs import one_line_messages

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(env_str("ACE_DATA_DIR", str(BASE_DIR / "var")))
DATA_DIR.mkdir(parents=True, exist_ok=True)


def _secret_key() -> str:
    key = os.environ.get("ACE_SECRET_KEY")
    if key:
        if len(key) < 32:
            raise ConfigError("ACE_SECRET_KEY must be at least 32 characters long")
        return key
    # Embedded default: a random key generated once and kept (mode 0600) in the data directory.
    path = DATA_DIR / "secret_key"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(50))
        path.chmod(0o600)
    return path.read_text().strip()


SECRET_KEY = _secret_key()


def _encryption_key() -> bytes:
    raw = os.environ.get("ACE_ENCRYPTION_KEY")
    if raw:
        try:
            decoded = base64.urlsafe_b64decode(raw.encode())
        except (ValueError, TypeError) as exc:
            raise ConfigError("ACE_ENCRYPTION_KEY must be a urlsafe-base64 32-byte Fernet key") from exc
        if len(decoded) != 32:
            raise ConfigError("ACE_ENCRYPTION_KEY must be a urlsafe-base64 32-byte Fernet key")
        return raw.encode()
    # Derived from the secret key when not given, so the embedded defaults work out of the box.
    return base64.urlsafe_b64encode(hashlib.sha256(b"ace-endpoint-keys:" + SECRET_KEY.encode()).digest())


ENDPOINT_KEY_ENCRYPTION_KEY = _encryption_key()

DEBUG = env_bool("ACE_DEBUG", False)
ALLOWED_HOSTS = [
    h.strip() for h in env_str("ACE_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",") if h.strip()
]
CSRF_TRUSTED_ORIGINS = [o.strip() for o in env_str("ACE_CSRF_TRUSTED_ORIGINS", "").split(",") if o.strip()]

# Which networks probing, the gateway and the worker may reach (fleet.netpolicy). Loopback and private ranges
# by default. Cloud metadata addresses in every form (169.254.0.0/16, fd00:ec2::254, 100.100.100.200, ...)
# and ACE's own Redis, database and web ports are refused even inside these networks.
ALLOWED_ENDPOINT_NETWORKS = env_networks(
    "ACE_ALLOWED_ENDPOINT_NETWORKS",
    "127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7",
)

# The web server's port, which no endpoint URL may point back at (the run command, ace.processes.start_asgi and
# docker-compose set it; 0: unknown, not checked).
WEB_PORT = env_int("ACE_WEB_PORT", 0, minimum=0)

# The only directories ACE reads model files from or writes them to (drafts, policy targets, EAGLE training
# runs), separated by ':'. ACE_HOME holds the demo models; speculation.services.model_files enforces this.
ACE_HOME = Path(env_str("ACE_HOME", "") or Path.home() / ".cache" / "ace")
MODEL_ROOTS = env_paths("ACE_MODEL_ROOTS", str(ACE_HOME / "models"))

PROBE_TIMEOUT_S = env_float("ACE_PROBE_TIMEOUT", 10.0, minimum=0.1)
PROBE_INTERVAL_S = env_int("ACE_PROBE_INTERVAL", 600, minimum=10)
# prod: how long the gateway waits for a worker to take a request, and for its next tokens, before falling back.
PROD_START_TIMEOUT_S = env_float("ACE_PROD_START_TIMEOUT", 5.0, minimum=0.1)
PROD_STEP_TIMEOUT_S = env_float("ACE_PROD_STEP_TIMEOUT", 30.0, minimum=0.1)
# prod: go plain where the guard's cost model, corrected by measured goodput, says speculation would be slower
# (speculation.gateway.guard).
GOODPUT_GUARD = env_bool("ACE_GOODPUT_GUARD", True)
# ...and above one request in flight, speculate at most this many of an endpoint's requests at once where speculation
# measured faster: the verdict is measured with one learner among plain neighbours (docs/BENCHMARKS.md, concurrency)
GOODPUT_SPECULATING = env_int("ACE_GOODPUT_SPECULATING", 1, minimum=1)
# ...and where the worker's engine shares the server's machine, learn loads above one request in flight anyway instead
# of presuming them slower (speculation.gateway.guard.topology.shares_machine; e.g. the server runs on its GPU)
GOODPUT_SHARED_LEARN = env_bool("ACE_GOODPUT_SHARED_LEARN", False)
# The GPU worker's torch (OpenMP) threads on a CPU (speculation.worker.openmp): idle threads spin this many
# iterations (GOMP_SPINCOUNT, about 0.1 ms at 10000; -1: OpenMP's default) and then sleep, so between steps they
# leave the cores to a model server on the same node; ACE_WORKER_OMP_PASSIVE sleeps at once instead (every parallel
# region then wakes its threads: the engine's steps run 2x slower, docs/BENCHMARKS.md). The batch
# loop's thread runs torch with up to ACE_WORKER_TORCH_THREADS threads (0: one per core; a step of fewer than 4
# requests one fewer, at least one), every other thread with one.
WORKER_OMP_PASSIVE = env_bool("ACE_WORKER_OMP_PASSIVE", False)
WORKER_OMP_SPINCOUNT = env_int("ACE_WORKER_OMP_SPINCOUNT", 10000, minimum=-1)
WORKER_TORCH_THREADS = env_int("ACE_WORKER_TORCH_THREADS", 0, minimum=0)
# Continuous batching (speculation.worker.batching): each GPU worker process serves up to this many local-path prod
# requests together in one batch loop and declares processes x slots to admission control; 0 = one engine loop
# per Celery task (a process serves one prod request at a time). The default suits a CPU; a GPU worker serves more
# (every slot's step must come within ACE_PROD_STEP_TIMEOUT, or the gateway falls back).
PROD_BATCH_SLOTS = env_int("ACE_BATCH_SLOTS", 8, minimum=0)
# Prefix caching in the batch loop (speculation.engine.prefix_cache): the KV rows of finished requests, kept per
# (target, draft) pair up to this many MiB, so that a request repeating a prefix prefills only the rest; 0 = off.
PROD_PREFIX_CACHE_MB = env_int("ACE_PREFIX_CACHE_MB", 256, minimum=0)
# Suffix decoding (speculation.worker.suffix_store): per endpoint, the responses of this many recent shadowed and
# prod requests are kept (in Redis, shared by the worker processes) to draft from; 0 = only the request's own
# context is looked up (prompt lookup with frequency voting).
SUFFIX_CACHE_REQUESTS = env_int("ACE_SUFFIX_CACHE_REQUESTS", 1000, minimum=0)
# Greedy slots draft the K that pays at the current batch size (K = 0, plain batched decoding, among them).
PROD_BATCH_LOAD_AWARE_K = env_bool("ACE_BATCH_LOAD_AWARE_K", True)
# shadow's projection: how long a GPU worker reuses its measured step costs (c, v) before timing them again.
COST_REFRESH_S = env_int("ACE_COST_REFRESH", 600, minimum=10)
# shadow's candidate replays (speculation.worker.candidates): per endpoint and minute, one candidate on one request
# (all K) each; the rest is shed and recorded as such. 0 turns candidate replays off.
CANDIDATE_REPLAYS_PER_MINUTE = env_int("ACE_CANDIDATE_REPLAYS_PER_MINUTE", 120, minimum=0)
# Models one GPU worker process keeps loaded (speculation.worker.paths.resources): weights + static KV caches, MB.
WORKER_MODEL_MB = env_int("ACE_WORKER_MODEL_MB", 4096, minimum=0)
# Where the worker's engine runs its models (speculation.worker.paths.resources): cpu, cuda or cuda:N; and in which
# dtype: auto is float32 on the CPU and, on CUDA, the checkpoint's bfloat16 / float16 (else bfloat16).
ENGINE_DEVICE = env_choice("ACE_ENGINE_DEVICE", "cpu", pattern=r"cpu|cuda(:\d+)?", what="cpu, cuda or cuda:N")
ENGINE_DTYPE = env_choice(
    "ACE_ENGINE_DTYPE", "auto", pattern="auto|float32|bfloat16|float16", what="auto, float32, bfloat16 or float16"
)
# Benchmarks only: prod runs its path with K = 0 (the engine's plain decoding, no draft step), so a benchmark can
# tell the gain of speculation apart from the path's own speed (bench_gateway's prod_over_plain_same_path).
PROD_PLAIN = env_bool("ACE_PROD_PLAIN", False)

# /metrics (ace.ops): served to loopback clients (unless ACE_METRICS_LOOPBACK=false) and to any client sending
# `Authorization: Bearer <ACE_METRICS_TOKEN>`.
METRICS_TOKEN = env_str("ACE_METRICS_TOKEN", "")
if METRICS_TOKEN and len(METRICS_TOKEN) < 16:
    raise ConfigError("ACE_METRICS_TOKEN must be at least 16 characters long")
METRICS_ALLOW_LOOPBACK = env_bool("ACE_METRICS_LOOPBACK", True)
# Prometheus multiprocess mode (several uvicorn or Celery processes): every process writes its samples there.
if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    Path(os.environ["PROMETHEUS_MULTIPROC_DIR"]).mkdir(parents=True, exist_ok=True)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "rest_framework.authtoken",
    "drf_spectacular",
    "drf_spectacular_sidecar",  # Swagger UI / ReDoc assets served from static files, no CDN
    "fleet",
    "speculation",
    "fleet.managed",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "ace.csp.ContentSecurityPolicyMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "ace.urls"
WSGI_APPLICATION = "ace.wsgi.application"
ASGI_APPLICATION = "ace.asgi.application"

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
                "fleet.context_processors.role",
            ],
        },
    },
]

DATABASE_URL = env_url(
    "DATABASE_URL", f"sqlite:///{DATA_DIR / 'ace.sqlite3'}", schemes=("sqlite", "postgres", "postgresql")
)
DATABASES = {"default": dj_database_url.parse(DATABASE_URL, conn_max_age=60)}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # WAL + a busy timeout: the web process and the worker write the same file.
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
    }
    DATABASES["default"]["CONN_MAX_AGE"] = 0
    # A file-based test database, so that a real Celery worker process can open it.
    DATABASES["default"]["TEST"] = {"NAME": env_str("ACE_TEST_DATABASE", str(DATA_DIR / "test.sqlite3"))}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Largest request body (gateway prompts, REST, forms); the gateway answers a larger one with an OpenAI-shaped 413.
DATA_UPLOAD_MAX_MEMORY_SIZE = env_int("ACE_MAX_BODY_BYTES", 10 * 1024 * 1024, minimum=1024)
# The gateway keeps what each API token may call in memory; a change made through ACE (token deleted, user
# deactivated, role or team changed) applies on the next request, any other change within this many seconds.
GATEWAY_AUTH_TTL_S = env_float("ACE_GATEWAY_AUTH_TTL", 5.0, minimum=0.0)
# Stage records: the web process's write queue (speculation.services.records drops a record beyond it, counted), how
# long raw records are kept, and per-minute rollups (older minutes are kept as hourly sums; the dashboard's longest
# range, a week, always reads per-minute ones). Pruned by beat's prune_records_task
# (speculation.services.records_retention).
RECORD_QUEUE_ROWS = env_int("ACE_RECORD_QUEUE", 10_000, minimum=1)
RECORD_RETENTION = env_duration("ACE_RECORD_RETENTION", "7d", minimum=timedelta(hours=1))
ROLLUP_RETENTION = env_duration("ACE_ROLLUP_RETENTION", "90d", minimum=timedelta(days=7))

# Throttles (ace.throttle, per web process): failed sign-ins per username and client address, and bad API tokens
# (REST and /v1) per client address, within ACE_THROTTLE_WINDOW seconds before a 429; 0 turns one off.
LOGIN_THROTTLE = env_int("ACE_LOGIN_THROTTLE", 10, minimum=0)
TOKEN_THROTTLE = env_int("ACE_TOKEN_THROTTLE", 20, minimum=0)
THROTTLE_WINDOW_S = env_int("ACE_THROTTLE_WINDOW", 300, minimum=1)

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = DATA_DIR / "staticfiles"

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "fleet:endpoint-list"
LOGOUT_REDIRECT_URL = "login"

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "ace.token_auth.ThrottledTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    # Reads: any signed-in user; writes: operators and admins. Object checks: fleet.permissions.
    "DEFAULT_PERMISSION_CLASSES": ["fleet.permissions.RolePermission"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    # JSON bodies nested at most 64 deep (ace.json_body) and within ACE_MAX_BODY_BYTES (ace.api.exception_handler):
    # a 400 / 413 as JSON, never a 500 or Django's HTML page.
    "EXCEPTION_HANDLER": "ace.api.exception_handler",
    "DEFAULT_PARSER_CLASSES": [
        "ace.json_body.JSONParser",
        "rest_framework.parsers.FormParser",
        "rest_framework.parsers.MultiPartParser",
    ],
    "DEFAULT_PAGINATION_CLASS": "ace.query_params.BoundedLimitOffsetPagination",
    "PAGE_SIZE": 50,
}
# /api/schema/ and /api/docs/: readable without signing in only when this is true.
API_DOCS_PUBLIC = env_bool("ACE_API_DOCS_PUBLIC", False)
SPECTACULAR_SETTINGS = {
    "TITLE": "ACE speculative decoding API",
    "DESCRIPTION": "Register LLM endpoints, probe them, and manage their speculative decoding stage.",
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    # One schema name per choice set (several models share field names like "kind" and "status").
    "ENUM_NAME_OVERRIDES": {
        "ServerKindEnum": "fleet.models.ServerKind",
        "EndpointStatusEnum": "fleet.models.EndpointStatus",
        "ProbeStatusEnum": "fleet.models.ProbeStatus",
        "DraftKindEnum": "speculation.models.DraftKind",  # also a policy's mechanism
    },
}

# Celery: one queue for control work, one per GPU node class ("gpu.<node_class>").
REDIS_URL = env_url("REDIS_URL", "redis://127.0.0.1:6379/0", schemes=("redis", "rediss", "unix"))
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = REDIS_URL
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = env_int("ACE_WORKER_PREFETCH", 1, minimum=1)
CELERY_TASK_ALWAYS_EAGER = env_bool("ACE_CELERY_EAGER", False)
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BROKER_TRANSPORT_OPTIONS = {"socket_connect_timeout": 2}
CELERY_REDIS_SOCKET_CONNECT_TIMEOUT = 2
CELERY_BEAT_SCHEDULE = {
    "reprobe-endpoints": {
        "task": "fleet.tasks.reprobe_all_task",
        "schedule": timedelta(seconds=PROBE_INTERVAL_S),
        "options": {"queue": "control"},
    },
    "refresh-rollups": {
        "task": "speculation.tasks.refresh_rollups_task",
        "schedule": timedelta(seconds=60),
        "options": {"queue": "control"},
    },
    "prune-records": {
        "task": "speculation.tasks.prune_records_task",
        "schedule": timedelta(minutes=10),
        "options": {"queue": "control"},
    },
    "retrain-from-captures": {
        "task": "speculation.tasks.retrain_from_captures_task",
        "schedule": timedelta(hours=1),
        "options": {"queue": "control"},
    },
}
CONTROL_QUEUE = "control"
DEFAULT_NODE_CLASS = env_str("ACE_DEFAULT_NODE_CLASS", "cpu")
# Managed endpoints (fleet.managed): the address their servers listen on, on the GPU worker's host.
MANAGED_HOST = env_str("ACE_MANAGED_HOST", "127.0.0.1")
# Before the route moves to a new instance that speculates, check its greedy answers in a mixed batch
# (fleet.managed.canary); false skips that check (recorded with each switch).
MANAGED_SWITCH_CANARY = env_bool("ACE_MANAGED_CANARY", True)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env_str("ACE_LOG_LEVEL", "INFO")},
    "loggers": {"httpx": {"level": "WARNING"}, "httpcore": {"level": "WARNING"}},
}
one_line_messages()  # a newline in a logged value (a URL, a name) cannot forge a log line: ace.logs
