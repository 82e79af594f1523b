"""The server arguments a user may set on a managed endpoint, and the command line ACE builds from them.

Only the listed arguments are accepted, each with its type and range: anything else (and the arguments ACE
sets itself: host, port, model, speculative config) is refused by name, because the server runs on ACE's
node with ACE's rights (`--trust-remote-code` would run code from the model directory, `--chat-template` reads
arbitrary files). Standard library only: the supervisor and the web process both use it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ace.processes import vllm_cpu_env

DTYPES = ("auto", "float32", "float16", "bfloat16")


class ServerArgsError(ValueError):
    """Bad server arguments: `errors` maps each offending argument to what is wrong with it."""

    def __init__(self, errors: dict[str, str]) -> None:
        super().__init__("; ".join(f"{k}: {v}" for k, v in errors.items()))
        self.errors = errors


def _int_in(low: int, high: int) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"an integer between {low} and {high}")
        return value

    return check


def _float_in(low: float, high: float) -> Callable[[Any], float]:
    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= float(value) <= high:
            raise ValueError(f"a number between {low} and {high}")
        return float(value)

    return check


def _choice(*choices: str) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        if value not in choices:
            raise ValueError(f"one of {', '.join(choices)}")
        return value

    return check


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false")
    return value


@dataclass(frozen=True)
class Arg:
    check: Callable[[Any], Any]
    vllm: str
    sglang: str


ALLOWED_ARGS: dict[str, Arg] = {
    "dtype": Arg(_choice(*DTYPES), "--dtype", "--dtype"),
    "max_model_len": Arg(_int_in(16, 1_048_576), "--max-model-len", "--context-length"),
    "tensor_parallel_size": Arg(_int_in(1, 64), "--tensor-parallel-size", "--tp-size"),
    "gpu_memory_utilization": Arg(_float_in(0.05, 0.99), "--gpu-memory-utilization", "--mem-fraction-static"),
    "enforce_eager": Arg(_bool, "--enforce-eager", "--disable-cuda-graph"),
}
# What ACE sets itself: named in the refusal so that the user knows why.
OWNED_BY_ACE = {"host", "port", "model", "model_path", "served_model_name", "speculative_config"}
DEFAULTS = {"dtype": "auto"}


def validate_server_args(args: Any) -> dict[str, Any]:
    """The cleaned arguments; ServerArgsError naming every unknown, unsafe or out-of-range argument."""
    if not isinstance(args, dict):
        raise ServerArgsError({"server_args": "must be an object of argument names to values"})
    errors: dict[str, str] = {}
    cleaned: dict[str, Any] = {}
    for name, value in args.items():
        key = str(name).replace("-", "_").lstrip("_")
        spec = ALLOWED_ARGS.get(key)
        if spec is None:
            why = "set by ACE itself" if key in OWNED_BY_ACE else "unknown or not allowed"
            errors[str(name)] = f"{why}; the arguments that can be set are: {', '.join(ALLOWED_ARGS)}"
            continue
        try:
            cleaned[key] = spec.check(value)
        except ValueError as exc:
            errors[str(name)] = f"must be {exc}"
    if errors:
        raise ServerArgsError(errors)
    return {**DEFAULTS, **cleaned}


def server_python(kind: str) -> str:
    """The interpreter that runs the server: vLLM's own virtual environment (ACE_VLLM_PYTHON), SGLang's
    (ACE_SGLANG_PYTHON, default: this interpreter)."""
    if kind == "vllm":
        home = Path(os.environ.get("ACE_HOME") or Path.home() / ".cache" / "ace")
        return os.environ.get("ACE_VLLM_PYTHON") or str(home / "vllm-venv" / "bin" / "python")
    return os.environ.get("ACE_SGLANG_PYTHON") or sys.executable


def build_argv(
    *, kind: str, model_dir: str, served_name: str, host: str, port: int, args: dict[str, Any], spec_args: list[str]
) -> list[str]:
    """The full command line of one server instance (spec_args: the native flags, [] for no speculation)."""
    python = server_python(kind)
    if kind == "vllm":
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
        argv += ["--served-model-name", served_name, "--host", host, "--port", str(port)]
    elif kind == "sglang":
        argv = [python, "-m", "sglang.launch_server", "--model-path", model_dir]
        argv += ["--served-model-name", served_name, "--host", host, "--port", str(port)]
    else:
        raise ValueError(f"ACE cannot run a {kind!r} server")
    for name, value in args.items():
        spec = ALLOWED_ARGS[name]
        flag = spec.vllm if kind == "vllm" else spec.sglang
        if isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    return argv + list(spec_args)


def server_env(kind: str) -> dict[str, str]:
    """Environment of a server instance: offline, no telemetry; vLLM's CPU build gets its KV cache and threads."""
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "DO_NOT_TRACK": "1"}
    if kind == "vllm":
        env["VLLM_NO_USAGE_STATS"] = "1"
        env.update(vllm_cpu_env())
    return env
