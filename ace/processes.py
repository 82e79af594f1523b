"""Start the real processes ACE needs on one machine: redis-server, a vLLM server, a Celery worker and beat.

Used by both the run command (`ace.launcher`) and the test fixtures (`tests/conftest.py`), so the tests start
exactly what the product starts. Standard library only: it must work before Django is set up.

Every process gets its own process group, writes its output to a log file, and is stopped with SIGTERM then
SIGKILL on the whole group (vLLM forks an engine core and workers).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parent.parent
STOP_GRACE_S = 10.0
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ace_home() -> Path:
    return Path(os.environ.get("ACE_HOME") or Path.home() / ".cache" / "ace")


def vllm_python() -> Path:
    """The interpreter of vLLM's own virtual environment (ACE_VLLM_PYTHON overrides)."""
    return Path(os.environ.get("ACE_VLLM_PYTHON") or ace_home() / "vllm-venv" / "bin" / "python")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now: bind port 0 and let the kernel choose."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ProcessFailed(RuntimeError):
    """A managed process exited or did not become ready; the message ends with the tail of its log."""


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen
    log_path: Path
    url: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever is left."""
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=grace_s)
        # Children that outlived their leader (vLLM's engine core) share its group id.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux to SIGTERM it when the parent dies, even by SIGKILL (no orphans)."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(
    name: str, argv: list[str], *, log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None
) -> ManagedProcess:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")  # noqa: SIM115 - the child owns it for its whole life
    logger.info("starting %s: %s (log %s)", name, " ".join(argv[:6]), log_path)
    popen = subprocess.Popen(
        argv,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        cwd=str(cwd or REPO_ROOT),
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    log.close()
    return ManagedProcess(name=name, popen=popen, log_path=log_path)


def run_manage(*args: str, env: dict[str, str], timeout_s: float = 600) -> str:
    """Run `manage.py ARGS` in the repository with `env` over this process's environment; its stdout, or a
    RuntimeError with the tail of both streams (the benchmark and fuzz stacks set up their databases so)."""
    done = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode:
        raise RuntimeError(f"manage.py {args[0]} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return done.stdout


def wait_until(proc: ManagedProcess, ready: Callable[[], bool], *, timeout_s: float, what: str) -> None:
    """Poll `ready()` until it is true; fail early if the process dies, or after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise ProcessFailed(f"{proc.name} exited ({proc.popen.returncode}) before {what}:\n{proc.log_tail()}")
        if ready():
            return
        time.sleep(0.5)
    proc.stop()
    raise ProcessFailed(f"{proc.name} was not {what} within {timeout_s:.0f} s:\n{proc.log_tail()}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback URL we built
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tcp_open(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
        return True
    return False


# --- redis -----------------------------------------------------------------------------------------------------


def redis_server_binary() -> str:
    found = shutil.which("redis-server") or ("/usr/bin/redis-server" if Path("/usr/bin/redis-server").exists() else "")
    if not found:
        raise ProcessFailed("redis-server is not installed: run scripts/setup.sh (apt-get install redis-server)")
    return found


def start_redis(*, workdir: Path, port: int | None = None, log_dir: Path, timeout_s: float = 20) -> ManagedProcess:
    """Debian's redis-server on a loopback port, no persistence, data in workdir."""
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        redis_server_binary(),
        *("--bind", "127.0.0.1", "--port", str(port), "--dir", str(workdir)),
        *("--save", "", "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no"),
    ]
    proc = spawn("redis", argv, log_path=log_dir / f"redis-{port}.log")
    wait_until(proc, lambda: _tcp_open("127.0.0.1", port), timeout_s=timeout_s, what="listening")
    proc.url = f"redis://127.0.0.1:{port}/0"
    proc.extra["port"] = port
    return proc


# --- vLLM ------------------------------------------------------------------------------------------------------

NGRAM_SPECULATIVE_CONFIG = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def vllm_cpu_env() -> dict[str, str]:
    """The environment of vLLM's CPU build here: its KV cache (VLLM_CPU_KVCACHE_SPACE, GiB), no thread binding, one
    process for its engine and model (ACE_VLLM_MULTIPROCESSING) and ACE_VLLM_OMP_THREADS (default 1; "0" leaves
    vLLM's own, one per core) OpenMP threads for the model.

    Why one process: vLLM runs its engine core and its model in two processes that talk over a shared-memory queue
    whose reader busy-waits for a second after each read; on a small CPU machine that spin takes a core the model's
    OpenMP threads need and whole rounds stall. With VLLM_ENABLE_V1_MULTIPROCESSING=0 the model runs in the engine
    core's process and nothing spins. "auto" (the default) does so where the machine has no NVIDIA device; "1" keeps
    vLLM's two processes, "0" forces one. Why one thread: through ACE on 2 cores the gateway's relay of every chunk
    takes a core, and two OpenMP threads then wait on each other at every parallel region's end (figures:
    docs/BENCHMARKS.md, "vLLM on CPU")."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
    }
    threads = os.environ.get("ACE_VLLM_OMP_THREADS", "1").strip()
    if threads not in ("", "0"):
        env["OMP_NUM_THREADS"] = threads
    raw = os.environ.get("ACE_VLLM_MULTIPROCESSING", "auto").strip().lower() or "auto"
    multiprocessing = {"1": "1", "true": "1", "yes": "1", "0": "0", "false": "0", "no": "0"}.get(raw)
    if multiprocessing is None:
        if raw != "auto":
            logger.warning("ACE_VLLM_MULTIPROCESSING=%r is not auto, 0 or 1: auto", raw)
        multiprocessing = "1" if glob.glob("/dev/nvidia[0-9]*") else "0"
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = multiprocessing
    return env


def start_vllm(
    *,
    model_dir: Path,
    log_dir: Path,
    port: int | None = None,
    served_model_name: str | None = None,
    speculative_config: dict | None = None,
    max_model_len: int = 1024,
    dev_mode: bool = False,
    timeout_s: float = 600,
) -> ManagedProcess:
    """A real vLLM (CPU build) OpenAI server serving model_dir on loopback; waits until /v1/models answers."""
    python = vllm_python()
    if not python.exists():
        raise ProcessFailed(f"vLLM's environment is missing ({python}): run scripts/setup.sh")
    port = port or free_port()
    argv = [
        str(python),
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"),
        *("--max-model-len", str(max_model_len), "--enforce-eager"),
    ]
    if served_model_name:
        argv += ["--served-model-name", served_model_name]
    if speculative_config:
        argv += ["--speculative-config", json.dumps(speculative_config)]
    env = {
        **vllm_cpu_env(),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    label = "vllm-ngram" if speculative_config else "vllm"
    proc = spawn(label, argv, log_path=log_dir / f"{label}-{port}.log", env=env)
    base_url = f"http://127.0.0.1:{port}"
    wait_until(proc, lambda: http_ok(base_url + "/v1/models"), timeout_s=timeout_s, what="serving /v1/models")
    proc.url = base_url
    proc.extra.update(port=port, model=served_model_name or str(model_dir))
    return proc


# --- Celery ----------------------------------------------------------------------------------------------------


def start_asgi(
    *,
    name: str,
    log_dir: Path,
    env: dict[str, str] | None = None,
    host: str = "127.0.0.1",
    port: int | None = None,
    quiet: bool = True,
    timeout_s: float = 60,
) -> ManagedProcess:
    """ACE's web process: uvicorn serving ace.asgi:application; `.url` set once it accepts connections.

    ACE_WEB_WORKERS (in `env` or this process's environment, default 1): that many uvicorn worker processes on the
    one port (set PROMETHEUS_MULTIPROC_DIR too, as the run command does, so /metrics sums them)."""
    port = port or free_port(host)
    env = {**(env or {}), "ACE_WEB_PORT": str(port)}  # its network policy refuses endpoint URLs pointing at itself
    argv = [sys.executable, "-m", "uvicorn", "ace.asgi:application", "--host", host, "--port", str(port)]
    raw = env.get("ACE_WEB_WORKERS") or os.environ.get("ACE_WEB_WORKERS") or "1"
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ProcessFailed(f"ACE_WEB_WORKERS must be a whole number of at least 1, not {raw!r}")
    workers = int(raw)
    if workers > 1:
        argv += ["--workers", str(workers)]
    if quiet:
        argv += ["--log-level", "warning", "--no-access-log"]
    proc = spawn(name, argv, log_path=log_dir / f"{name}.log", env=env)
    wait_until(proc, lambda: _tcp_open(host, port), timeout_s=timeout_s, what="listening")
    proc.url = f"http://{host}:{port}"
    return proc


def celery_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "ace", *args]


def start_celery_worker(
    *,
    env: dict[str, str],
    log_dir: Path,
    queues: str = "control,gpu.cpu",
    name: str = "ace-worker",
    concurrency: int = 1,
    timeout_s: float = 60,
) -> ManagedProcess:
    """A real `celery worker` consuming the given queues; waits until it answers a ping."""
    hostname = f"{name}-{os.getpid()}-{free_port()}@%h"
    argv = celery_argv(
        "worker",
        *("-Q", queues, "-n", hostname, "--concurrency", str(concurrency), "--pool", "prefork"),
        *("--loglevel", "INFO", "--without-gossip", "--without-mingle", "--prefetch-multiplier", "1"),
    )
    proc = spawn("celery-worker", argv, log_path=log_dir / f"celery-worker-{os.getpid()}.log", env=env)
    # The worker logs "<hostname> ready." once it consumes; cheaper to watch than `celery inspect ping`.
    wait_until(proc, lambda: " ready." in proc.log_tail(200), timeout_s=timeout_s, what="ready")
    return proc


def start_celery_beat(*, env: dict[str, str], log_dir: Path, workdir: Path) -> ManagedProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    argv = celery_argv("beat", "--loglevel", "INFO", "--schedule", str(workdir / "celerybeat-schedule"))
    proc = spawn("celery-beat", argv, log_path=log_dir / "celery-beat.log", env=env)
    time.sleep(1)
    if not proc.alive():
        raise ProcessFailed(f"celery beat exited:\n{proc.log_tail()}")
    return proc
