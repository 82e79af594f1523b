"""Session fixtures that start the real processes the product runs with (see ace.processes).

- `redis_server`: Debian's redis-server on a free loopback port; Celery (and settings.REDIS_URL) point at it.
- `demo_pair`: the locally built demo target/draft pair (speculation.offline.demo.ensure_demo_pair).
- `vllm_server` / `vllm_ngram_server`: a real vLLM (CPU build) serving the demo target, plain / with vLLM's own
  n-gram speculative decoding. Handles with `.base_url` and `.model`.
- `celery_worker`: a real `celery worker` subprocess (queues control and gpu.cpu) on this session's test
  database; tests using it need `@pytest.mark.django_db(transaction=True)`.

Each process starts once per session, logs to test-artifacts/, and is stopped at the end of the session.
Every test session gets its own SQLite test database file, so concurrent runs never share one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from ace import processes
from ace.launcher import DEMO_MODEL_NAME

ARTIFACTS = processes.REPO_ROOT / "test-artifacts"


@dataclass(frozen=True)
class ModelServer:
    base_url: str
    model: str
    process: processes.ManagedProcess


def pytest_configure(config: pytest.Config) -> None:
    # A session stopped with SIGTERM (CI timeouts, `timeout`) unwinds like Ctrl-C, so the session fixtures
    # stop the processes they started.
    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    # The tests of speculation need their prod requests to speculate: the goodput guard (which sends a load plain
    # where speculation measured slower than plain) is off here, for this process and the ones it starts; its own
    # tests turn it on (tests/speculation/gateway/test_gateway_goodput.py).
    from django.conf import settings

    os.environ.setdefault("ACE_GOODPUT_GUARD", "false")
    # The processes tests start serve a whole session's bad-token tests from one address: no throttle there.
    os.environ.setdefault("ACE_TOKEN_THROTTLE", "0")
    settings.GOODPUT_GUARD = os.environ["ACE_GOODPUT_GUARD"].lower() in ("1", "true", "yes")


@pytest.fixture(autouse=True)
def throttles_start_empty() -> Iterator[None]:
    """Failed sign-ins and bad tokens are counted per process (ace.throttle): each test starts from none."""
    from ace import throttle

    throttle.logins.clear()
    throttle.tokens.clear()
    yield


@pytest.fixture(autouse=True)
def writes_behind_stay_in_their_test() -> Iterator[None]:
    """Stage records and captures a test queued and never flushed belong to its database: they are dropped when it
    ends, rather than written into the next test's, or at exit after pytest-django dropped the database."""
    yield
    for name in ("speculation.services.records", "speculation.services.captures"):
        module = sys.modules.get(name)
        if module is not None:
            module.writer.queue.clear()


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """One SQLite test database file per session (ACE_TEST_DATABASE still wins when set)."""
    from django.conf import settings

    database = settings.DATABASES["default"]
    if database["ENGINE"].endswith("sqlite3") and not os.environ.get("ACE_TEST_DATABASE"):
        database.setdefault("TEST", {})["NAME"] = str(settings.DATA_DIR / f"test-{os.getpid()}.sqlite3")


@pytest.fixture(scope="session", autouse=True)
def model_roots_include_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Model files may lie only under ACE_MODEL_ROOTS: the tests' tmp dirs join the default root (the demo
    models), here and in every process a test starts (the worker registers trained EAGLE heads)."""
    from django.conf import settings

    base = Path(os.path.realpath(tmp_path_factory.getbasetemp()))
    settings.MODEL_ROOTS = [*settings.MODEL_ROOTS, base]
    os.environ["ACE_MODEL_ROOTS"] = os.pathsep.join(str(root) for root in settings.MODEL_ROOTS)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="session")
def redis_server(artifacts_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[processes.ManagedProcess]:
    proc = processes.start_redis(workdir=tmp_path_factory.mktemp("redis"), log_dir=artifacts_dir)
    _point_celery_at(proc.url)
    try:
        yield proc
    finally:
        proc.stop()


def _point_celery_at(url: str) -> None:
    from django.conf import settings

    from ace.celery import app

    settings.REDIS_URL = settings.CELERY_BROKER_URL = settings.CELERY_RESULT_BACKEND = url
    app.conf.broker_url = url
    app.conf.result_backend = url
    # Drop connections made to the previous broker URL (pools are keyed by connection).
    app._pool = None
    app.amqp._producer_pool = None


@pytest.fixture(scope="session")
def demo_pair():
    from speculation.offline.demo import ensure_demo_pair

    return ensure_demo_pair()


def _start_model_server(demo_pair, artifacts_dir: Path, **kwargs) -> Iterator[ModelServer]:
    proc = processes.start_vllm(
        model_dir=demo_pair.target_dir, served_model_name=DEMO_MODEL_NAME, log_dir=artifacts_dir, **kwargs
    )
    try:
        # A fresh machine's first generation is slow (the CPU kernels' first run at each shape: 10 s and more, once
        # per server): made here, so that the tests' probes (10 s) see the server's usual speed.
        httpx.post(
            proc.url + "/v1/completions",
            json={"model": DEMO_MODEL_NAME, "prompt": "Warm up.", "max_tokens": 8},
            timeout=180,
        )
        yield ModelServer(base_url=proc.url, model=DEMO_MODEL_NAME, process=proc)
    finally:
        proc.stop()


@pytest.fixture(scope="session")
def vllm_server(demo_pair, artifacts_dir: Path) -> Iterator[ModelServer]:
    yield from _start_model_server(demo_pair, artifacts_dir)


@pytest.fixture(scope="session")
def vllm_ngram_server(demo_pair, artifacts_dir: Path) -> Iterator[ModelServer]:
    # Dev mode adds /server_info, the only place vLLM names its speculative method. Its first call collects
    # the host's environment (seconds): made once here so that probes in the tests see its usual speed.
    servers = _start_model_server(
        demo_pair, artifacts_dir, speculative_config=processes.NGRAM_SPECULATIVE_CONFIG, dev_mode=True
    )
    server = next(servers)
    try:
        httpx.get(server.base_url + "/server_info", timeout=120)
        yield server
    finally:
        servers.close()


@pytest.fixture(scope="session")
def celery_worker(
    django_db_setup: None,
    django_db_blocker,
    redis_server: processes.ManagedProcess,
    artifacts_dir: Path,
) -> Iterator[processes.ManagedProcess]:
    """A real worker on the test database, started after the database exists."""
    env = {
        "DATABASE_URL": _test_database_url(),
        "REDIS_URL": redis_server.url,
        "DJANGO_SETTINGS_MODULE": "ace.settings",
        "ACE_CELERY_EAGER": "false",
    }
    proc = processes.start_celery_worker(env=env, log_dir=artifacts_dir)
    try:
        yield proc
    finally:
        proc.stop()


def _test_database_url() -> str:
    from django.db import connection

    params = connection.settings_dict
    if params["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{params['NAME']}"
    auth = params["USER"] + (f":{params['PASSWORD']}" if params.get("PASSWORD") else "")
    return f"postgresql://{auth}@{params['HOST']}:{params['PORT'] or 5432}/{params['NAME']}"


# --- small local HTTP servers ------------------------------------------------------------------------------------
# The one place a stand-in server is allowed: failure modes (401, 404, non-JSON, bad shapes, slow answers) and
# SGLang's response shapes, which no real server here produces. They are real HTTP servers on loopback.


@dataclass
class StubRequest:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self):
        import json

        return json.loads(self.body or b"null")


StubReply = tuple[int, dict[str, str], bytes]


@pytest.fixture
def http_stub():
    """Start a loopback HTTP server from {(METHOD, path): handler(StubRequest) -> reply}; returns its base URL.

    A handler returns (status, headers, body bytes), or a dict/list (sent as JSON with 200). Requests are
    recorded in `server.requests` on the returned object's `.requests`.
    """
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from urllib.parse import urlsplit

    servers: list[ThreadingHTTPServer] = []

    class Stub:
        def __init__(self, base_url: str, requests: list[StubRequest]) -> None:
            self.base_url = base_url
            self.requests = requests

    def start(routes) -> Stub:
        requests: list[StubRequest] = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _handle(self) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("content-length") or 0)
                request = StubRequest(
                    self.command,
                    parts.path,
                    parts.query,
                    {k.lower(): v for k, v in self.headers.items()},
                    self.rfile.read(length) if length else b"",
                )
                requests.append(request)
                handler = routes.get((self.command, parts.path))
                if handler is None:
                    reply: StubReply = (404, {"content-type": "application/json"}, b'{"detail":"Not Found"}')
                else:
                    result = handler(request)
                    if isinstance(result, dict | list):
                        reply = (200, {"content-type": "application/json"}, json.dumps(result).encode())
                    else:
                        reply = result
                status, headers, body = reply
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up (timeouts)
                    self.wfile.write(body)

            do_GET = do_POST = _handle  # noqa: N815 - http.server's naming

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return Stub(f"http://127.0.0.1:{server.server_address[1]}", requests)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()
