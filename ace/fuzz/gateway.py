"""Fuzz the gateway's bodies: valid requests with one field (or several) replaced by odd values or by the input
classes of ace.fuzz.classes, missing or extra fields, bodies that are not JSON objects, and a body over the size
limit, against /v1/completions and /v1/chat/completions of an endpoint in each mode. Every answer is tallied; a
5xx, or an error that is not OpenAI-shaped or lacks X-ACE-Request-Id, is kept as a finding."""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from ace.fuzz.classes import DEEP_JSON, gateway_changes
from speculation import openai_fields

PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
REQUEST_ID_HEADER = "X-ACE-Request-Id"

ODD_VALUES: list[Any] = [
    *(None, True, False, 0, 1, -1, 2, 3, 0.5, -0.5, 2.5, 1e308, -1e308, 2**63, -(2**63) - 1, 2**64),
    *("", "hot", "0", "\x00", "\U0001f642" * 20, "x" * 4000),
    *([], [0], [-1], [1.5], ["a"], [[1, 2]], [[]], [None], {}, {"a": 1}, {"type": "text"}, {"include_usage": "no"}),
]
FIELDS = {route: list(names) for route, names in openai_fields.ROUTE_ONLY.items()}
COMMON_FIELDS = ["model", *openai_fields.COMMON, "an_unknown_field"]
RAW_BODIES: list[bytes] = [
    *(b"", b"null", b"[]", b'"text"', b"{", b"\xff\xfe\x00", b"[" * 50_000, b'{"model": 5}', b'{"model": null}'),
    *(b'{"model": "no-such-model", "prompt": "x"}', b'{"prompt": "no model"}', DEEP_JSON),
]
# Bodies per (mode, route): a CPU model server answers a valid request in about a second.
QUICK_SINGLES, QUICK_MULTI, QUICK_CLASSES = 40, 10, 16
FULL_SINGLES, FULL_MULTI = 300, 60
OVERSIZE_BYTES = 12 * 1024 * 1024  # over ACE_MAX_BODY_BYTES' default (10 MiB)


def templates(kind: str, model: str) -> list[dict[str, Any]]:
    """Requests a model server accepts (short: generation on a CPU server costs time)."""
    if kind == "completion":
        base: dict[str, Any] = {"model": model, "prompt": "def add(a, b):", "max_tokens": 4, "temperature": 0}
        return [base, {**base, "stream": True}, {**base, "temperature": 0.8, "top_p": 0.9, "seed": 1}]
    base = {"model": model, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4, "temperature": 0}
    return [base, {**base, "stream": True, "stream_options": {"include_usage": True}}]


def bodies(kind: str, model: str, *, rng: random.Random, quick: bool) -> Iterator[bytes]:
    """The bodies to send for one (kind, endpoint): a seeded sample of single-field changes, then multi-field
    ones, a missing prompt/messages, and raw bodies that are not JSON objects."""
    bases = templates(kind, model)
    singles = [(name, value) for name in [*COMMON_FIELDS, *FIELDS[kind]] for value in ODD_VALUES]
    singles = rng.sample(singles, QUICK_SINGLES if quick else FULL_SINGLES)
    for base in bases[:1]:
        yield json.dumps(base).encode()
    for name, value in singles:
        yield json.dumps({**rng.choice(bases), name: value}).encode()
    changes = gateway_changes(kind)  # the input classes (ace.fuzz.classes): all of them, or a sample
    for name, value in changes if not quick else rng.sample(changes, QUICK_CLASSES):
        yield json.dumps({**rng.choice(bases), name: value}).encode()
    for _ in range(QUICK_MULTI if quick else FULL_MULTI):  # several fields at once
        body = dict(rng.choice(bases))
        for name, value in rng.sample(singles, 3):
            body[name] = value
        yield json.dumps(body).encode()
    required = "prompt" if kind == "completion" else "messages"
    yield json.dumps({k: v for k, v in bases[0].items() if k != required}).encode()
    yield from RAW_BODIES


@dataclass
class GatewayReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: int = 0  # 5xx that are ACE's own
    upstream_server_errors: int = 0  # 5xx the model server itself gives for the same body (relayed as they are)
    unshaped_errors: int = 0  # a 4xx/5xx from ACE that is not {"error": {...}} JSON
    missing_request_id: int = 0
    transport_errors: int = 0
    findings: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0]))},
            "server_errors": self.server_errors,
            "upstream_server_errors": self.upstream_server_errors,
            "unshaped_errors": self.unshaped_errors,
            "missing_request_id": self.missing_request_id,
            "transport_errors": self.transport_errors,
            "findings": self.findings[:50],
        }


def _openai_shaped(response: httpx.Response) -> bool:
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and isinstance(error.get("message"), str)


def _note(report: GatewayReport, problem: str, mode: str, path: str, body: bytes, status: int | str) -> None:
    if len(report.findings) < 200:
        shown = body[:300].decode(errors="replace")
        report.findings.append({"problem": problem, "mode": mode, "path": path, "status": status, "body": shown})


DROPPED = (httpx.RemoteProtocolError, httpx.ReadError)


@dataclass(frozen=True)
class Upstream:
    """The model server behind the endpoints, asked directly to tell its own 5xx from ACE's."""

    url: str
    served_model: str

    def also_fails(self, path: str, body: bytes, timeout_s: float) -> bool:
        try:
            request = json.loads(body)
        except ValueError:
            return False
        if not isinstance(request, dict):
            return False
        request["model"] = self.served_model
        try:
            return httpx.post(self.url + path, json=request, timeout=timeout_s).status_code >= 500
        except DROPPED:  # the server closed the connection on this body: ACE's 502 relays the server's failure
            return True
        except httpx.HTTPError:
            return False


def fuzz_gateway(
    *,
    ace_url: str,
    token: str,
    models: dict[str, str],
    quick: bool,
    upstream: Upstream | None = None,
    seed: int = 0,
    timeout_s: float = 120,
) -> GatewayReport:
    """models: mode -> endpoint name. Sends every body to each mode's endpoint on both routes."""
    rng = random.Random(seed)
    report = GatewayReport()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=ace_url, headers=headers, timeout=timeout_s) as http:
        for mode, model in models.items():
            for kind, path in PATHS.items():
                sent = list(bodies(kind, model, rng=rng, quick=quick))
                sent.append(b'{"model": "' + model.encode() + b'", "prompt": "' + b"x" * OVERSIZE_BYTES + b'"}')
                for body in sent:
                    _send(http, report, mode, path, body, upstream=upstream)
    return report


def _send(
    http: httpx.Client, report: GatewayReport, mode: str, path: str, body: bytes, *, upstream: Upstream | None = None
) -> None:
    report.requests += 1
    try:
        response = http.post(path, content=body)
    except httpx.HTTPError as exc:
        report.transport_errors += 1
        report.statuses[type(exc).__name__] += 1
        _note(report, f"transport error {type(exc).__name__}", mode, path, body, type(exc).__name__)
        return
    status = response.status_code
    report.statuses[status] += 1
    if status >= 500 and upstream is not None and upstream.also_fails(path, body, http.timeout.read or 120):
        report.upstream_server_errors += 1
        _note(report, "5xx from the model server itself (relayed)", mode, path, body, status)
    elif status >= 500:
        report.server_errors += 1
        _note(report, "5xx", mode, path, body, status)
    if status >= 400 and not _openai_shaped(response):
        report.unshaped_errors += 1
        _note(report, "error is not OpenAI-shaped JSON", mode, path, body, status)
    if not response.headers.get(REQUEST_ID_HEADER):
        report.missing_request_id += 1
        _note(report, "no request id", mode, path, body, status)
