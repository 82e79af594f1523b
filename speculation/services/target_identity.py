"""Does a target_path hold the endpoint's own model? It must reproduce the served model's answers on the canary.

A local target verifies every token ACE serves on the local path, so a folder holding any other checkpoint (a draft,
a fine-tune, an older revision) with the same tokenizer would serve that model's text as the endpoint's. The probe
records the served model's greedy continuation of the canary and its top log-probabilities (fleet.adapters:
`canary_reference`); the local checkpoint must reproduce both within the tolerances of speculation.engine.identity
(which states them and the measurements behind them). Where the server returns no log-probabilities the greedy
continuation alone is compared, and the verdict says so.

A managed endpoint's server is started by ACE from its model directory: that directory is its model by
construction (the reference of a server started from an earlier build would refuse a rebuilt one before the new
server runs).

Checked at policy save (speculation.services.policies), when the worker builds the local path
(speculation.worker.generation), and for the candidates auto-pairing replays with the target. The verdict is kept
per endpoint, reference, folder and the files' sizes and modification times, so it is computed once, not per
request. A process without torch (the web process) runs the check in a child process
(`python -m speculation.engine.identity`); one that has torch already (the worker) runs it in its own.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.cache import cache

from fleet.models import Endpoint

logger = logging.getLogger(__name__)

# Loading a large target from disk in the child process; the demo target takes about 3 s with torch's import.
CHECK_TIMEOUT_S = 600
CACHE_PREFIX = "ace:target-identity:v1"
NOT_IT = "target_path does not reproduce the endpoint's model"


@dataclass(frozen=True)
class Identity:
    """problem: "" when target_path holds the endpoint's model, else what differed or why it cannot be told;
    note: how it was told (e.g. greedy continuation alone)."""

    problem: str
    note: str = ""


def check(*, endpoint: Endpoint, target_path: str) -> Identity:
    """Whether the model in target_path reproduces the endpoint's served model (cached verdict)."""
    if _managed_from(endpoint, target_path):  # ACE starts the endpoint's server from these very files
        return Identity("", "the endpoint's managed server runs target_path itself")
    reference, why_none = _reference(endpoint)
    if reference is None:
        return Identity(f"cannot check that target_path holds the endpoint's model: {why_none}")
    key = _cache_key(endpoint, target_path, reference)
    found = cache.get(key)
    if found is None:
        verdict = _run(target_path, reference)
        if "error" in verdict:
            found = f"cannot check that target_path holds the endpoint's model: {verdict['error']}"
        else:
            found = _describe(verdict, reference, target_path)
        if not verdict.get("transient"):  # a timeout is tried again; anything else holds for these very files
            cache.set(key, found, timeout=None)
        logger.info("target identity of %s for endpoint %s: %s", target_path, endpoint.pk, found or "reproduced")
    note = "" if reference.get("top_logprobs") else f"greedy continuation alone: {reference.get('greedy_only') or ''}"
    return Identity(found, note)


def _reference(endpoint: Endpoint) -> tuple[dict[str, Any] | None, str]:
    """The probe's reference, or (None, why there is none)."""
    caps = endpoint.capabilities or {}
    found = caps.get("canary_reference")
    if isinstance(found, dict) and found.get("token_ids"):
        return found, ""
    from fleet.adapters import Unsupported, wire_for

    try:
        wire_for(endpoint.kind).continuation(model="", token_ids=[0], max_tokens=1, fields={}, stream=False)
    except Unsupported as exc:
        return None, f"the server cannot say which tokens its model generates ({exc.reason})"
    return None, "no probe has recorded the served model's answers on the canary yet (probe the endpoint)"


def _managed_from(endpoint: Endpoint, target_path: str) -> bool:
    from fleet.managed.models import ManagedServer

    model_dir = ManagedServer.objects.filter(endpoint=endpoint).values_list("model_dir", flat=True).first()
    return bool(model_dir) and os.path.realpath(model_dir) == os.path.realpath(target_path)


def _files_signature(directory: Path) -> list[tuple[str, int, int]]:
    files = [directory / "config.json", *sorted(directory.glob("*.safetensors"))]
    signature = []
    for file in files:
        try:
            stat = file.stat()
        except OSError:
            continue
        signature.append((file.name, stat.st_size, stat.st_mtime_ns))
    return signature


def _cache_key(endpoint: Endpoint, target_path: str, reference: dict[str, Any]) -> str:
    directory = Path(os.path.realpath(target_path))
    material = json.dumps([endpoint.pk, str(directory), _files_signature(directory), reference], sort_keys=True)
    return f"{CACHE_PREFIX}:{hashlib.sha256(material.encode()).hexdigest()}"


def _run(target_path: str, reference: dict[str, Any]) -> dict[str, Any]:
    """The engine's verdict as JSON: in this process where torch is loaded, else in a child process."""
    return _run_here(target_path, reference) if "torch" in sys.modules else _run_in_child(target_path, reference)


def _run_here(target_path: str, reference: dict[str, Any]) -> dict[str, Any]:
    from speculation.engine.identity import Reference, check_directory

    try:
        return check_directory(target_path, Reference.from_json(reference)).as_json()
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _run_in_child(target_path: str, reference: dict[str, Any]) -> dict[str, Any]:
    request = json.dumps({"directory": target_path, "reference": reference})
    try:
        done = subprocess.run(
            [sys.executable, "-m", "speculation.engine.identity"],
            input=request,
            capture_output=True,
            text=True,
            timeout=CHECK_TIMEOUT_S,
            cwd=settings.BASE_DIR,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"loading target_path took longer than {CHECK_TIMEOUT_S} s", "transient": True}
    try:
        return json.loads(done.stdout)
    except json.JSONDecodeError:
        logger.warning("target identity check of %s failed: %s", target_path, done.stderr[-2000:])
        return {"error": f"the check's process failed (exit code {done.returncode})", "transient": True}


def _describe(verdict: dict[str, Any], reference: dict[str, Any], target_path: str) -> str:
    """What differed, in the server's and the local model's own tokens ("" when nothing did)."""
    mismatch = verdict.get("mismatch")
    if not mismatch:
        return ""
    text = _decoder(target_path)
    server, local = text(mismatch["server_token"]), text(mismatch["local_token"])
    if mismatch["kind"] == "vocab":
        return f"{NOT_IT}: the server generated token id {mismatch['server_token']}, outside the local vocabulary"
    if mismatch["kind"] == "greedy":
        only = "" if reference.get("top_logprobs") else " (the endpoint returns no log-probabilities: greedy alone)"
        return (
            f"{NOT_IT}: greedy continuation of the probe's canary differs at token {mismatch['index'] + 1} "
            f"(server {server}, local {local}){only}"
        )
    return (
        f"{NOT_IT}: top log-probabilities of the probe's canary differ by {mismatch['nats']:.2f} nats "
        f"(token {server} at position {mismatch['index']}; tolerance {verdict.get('tolerance_nats')} nats)"
    )


def _decoder(target_path: str) -> Any:
    """token id -> its text, quoted (the id where the tokenizer cannot say)."""
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(Path(target_path) / "tokenizer.json"))
    except Exception:  # noqa: BLE001 - a message without token texts is still the message
        return lambda token: f"id {token}"
    return lambda token: repr(tokenizer.decode([token])) if token >= 0 else "none"
