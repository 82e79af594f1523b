"""What every server adapter shares: the probe report, failure kinds, and the HTTP client that classifies errors.

The capabilities dict an adapter fills (stable keys; the UI, the API and the speculation stage read them):

    server_kind             "vllm" | "sglang" | "openai"
    server_version          str | None
    models                  list[str]: every served model id
    served_model            str: the model ACE talks to (the first served id)
    max_context             int | None: the model's context length in tokens
    tokenize, detokenize    bool: the server tokenizes / detokenizes text for us
    token_id_prompts        bool: the server takes a prompt as a list of token ids
    prompt_scoring          bool: the server returns log-probabilities of the prompt tokens
    prompt_scoring_method   "prompt_logprobs" (vLLM) | "echo_logprobs" (OpenAI) | "return_logprob" (SGLang) | None
    max_logprobs            int | None: the largest top-logprobs count the server accepted
    tokenizer_fingerprint   str | None: sha256 of the token ids of CANARY_TEXT, special tokens added (as the
                            server tokenizes by default; a local tokenizer: add_special_tokens=True)
    canary_token_ids        list[int] | None: those token ids
    canary_reference        {"token_ids", "prompt_len", "top_logprobs", "greedy_only"} | None: the canary's token
                            ids and the server's greedy continuation of them, with its top log-probabilities at
                            every position ([[id, logprob], ...]; null with the reason in greedy_only where the
                            server returns none); None where the server cannot continue token ids
    native_speculation      bool | None: the server runs speculative decoding itself (None: it does not say)
    native_speculation_method, native_speculation_k, native_speculation_source
    ttft_ms, tpot_ms        float | None: measured time to first token and per output token (short greedy stream)
    latency_output_tokens   int | None: how many tokens that stream produced

Every failure is a `ProbeError` with a `FailureKind`; an adapter never lets another exception escape `probe()`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import ssl
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar, Protocol

import httpx

from fleet import netpolicy
from fleet.adapters.wire import WireError, WireRequest

logger = logging.getLogger(__name__)

# Fixed text whose token ids identify a tokenizer. Changing it changes every fingerprint: bump CANARY_VERSION.
CANARY_TEXT = "ACE tokenizer canary v1: The quick brown fox jumps over the lazy dog; 0123456789, ¿qué? naïve café."
CANARY_VERSION = 1
# The served model's own answers on the canary, kept as the reference a local copy of its model must reproduce
# (speculation.services.target_identity): its greedy continuation of this many tokens, and the top log-probabilities
# (at most this many per position) over the canary and that continuation.
REFERENCE_TOKENS = 16
REFERENCE_TOP_N = 5
# Top-logprobs counts tried, largest first; the first one accepted is recorded as max_logprobs.
LOGPROBS_CANDIDATES = (20, 10, 5, 1)
# The short greedy stream that measures TTFT and time per output token.
LATENCY_PROMPT = "The capital of France is"
LATENCY_MAX_TOKENS = 16
# How much of an error body goes into a recorded reason.
BODY_SNIPPET_CHARS = 200


class FailureKind(StrEnum):
    NOT_ALLOWED = "not_allowed"
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    TLS_ERROR = "tls_error"
    UNAUTHORIZED = "unauthorized"
    NOT_FOUND = "not_found"
    HTTP_ERROR = "http_error"
    NOT_JSON = "not_json"
    WRONG_SHAPE = "wrong_shape"
    UNSUPPORTED = "unsupported"
    INTERNAL = "internal"


class ProbeError(Exception):
    """One failed request or an answer ACE cannot use, with the kind of failure and a human reason."""

    def __init__(self, kind: FailureKind, message: str, *, status_code: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status_code = status_code

    def as_record(self, step: str) -> dict[str, Any]:
        record: dict[str, Any] = {"step": step, "kind": str(self.kind), "message": self.message}
        if self.status_code is not None:
            record["status_code"] = self.status_code
        return record


def shape_error(what: str) -> ProbeError:
    return ProbeError(FailureKind.WRONG_SHAPE, f"unexpected response shape: {what}")


@dataclass
class ProbeReport:
    """The outcome of one probe: what was found, what failed, and the failure that stopped it (if any)."""

    capabilities: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    fatal: ProbeError | None = None

    @property
    def ok(self) -> bool:
        return self.fatal is None


def fingerprint(token_ids: list[int]) -> str:
    """sha256 over the canary's token ids: equal fingerprints mean the same tokenization of the canary."""
    return hashlib.sha256(json.dumps([int(t) for t in token_ids], separators=(",", ":")).encode()).hexdigest()


class ServerAdapter(Protocol):
    """One client per server kind. `probe` never raises: failures are in the report."""

    kind: ClassVar[str]
    base_url: str

    def probe(self) -> ProbeReport: ...


class ServerClient:
    """A thin httpx client that turns every transport or protocol problem into a ProbeError.

    The API key travels only in the Authorization header; it is never part of a message or a log line.
    Redirects are not followed: a redirect could lead outside the allowed networks. Sockets connect only to
    addresses the network policy checked (fleet.netpolicy.PinnedTransport).
    """

    def __init__(self, base_url: str, *, api_key: str = "", timeout_s: float) -> None:
        headers = {"Accept": "application/json", "User-Agent": "ace-probe/1"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s),
            follow_redirects=False,
            transport=netpolicy.PinnedTransport(),
        )

    def __enter__(self) -> ServerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()

    def get_json(self, path: str, *, params: dict[str, str] | None = None, timeout_s: float | None = None) -> Any:
        timeout = httpx.Timeout(timeout_s) if timeout_s else httpx.USE_CLIENT_DEFAULT
        return _decode_json(self._send("GET", path, params=params, timeout=timeout), path)

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        return _decode_json(self._send("POST", path, json=body), path)

    def get_text(self, path: str) -> str:
        return self._send("GET", path).text

    def send(self, request: WireRequest) -> Any:
        """A request-time operation's request (fleet.adapters.wire); its answer decoded from JSON."""
        if request.method == "GET":
            return self.get_json(request.path)
        return self.post_json(request.path, request.json or {})

    def stream_events(self, path: str, body: dict[str, Any]) -> Iterator[tuple[float, dict[str, Any]]]:
        """POST with streaming; yield (perf_counter time, decoded JSON) per server-sent `data:` event."""
        try:
            with self._client.stream("POST", path, json=body) as response:
                _check_status(response, path)
                for line in response.iter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue
                    data = line[len("data:") :].strip()
                    if data == "[DONE]":
                        return
                    try:
                        yield now, json.loads(data)
                    except json.JSONDecodeError as exc:
                        raise ProbeError(FailureKind.NOT_JSON, f"{path}: a streamed event is not JSON") from exc
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.base_url + path, self.timeout_s) from exc

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise _transport_error(exc, self.base_url + path, self.timeout_s) from exc
        _check_status(response, path)
        return response


def _check_status(response: httpx.Response, path: str) -> None:
    code = response.status_code
    if code < 300:
        return
    if response.is_stream_consumed is False and not response.is_closed:
        response.read()
    snippet = _snippet(response)
    if code in (401, 403):
        raise ProbeError(
            FailureKind.UNAUTHORIZED, f"{path}: HTTP {code}: the server refused the API key", status_code=code
        )
    if code == 404:
        raise ProbeError(
            FailureKind.NOT_FOUND,
            f"{path}: HTTP 404: not found (wrong base URL path or wrong server kind?)",
            status_code=code,
        )
    if 300 <= code < 400:
        location = response.headers.get("location", "?")
        raise ProbeError(
            FailureKind.HTTP_ERROR, f"{path}: HTTP {code} redirect to {location} (not followed)", status_code=code
        )
    raise ProbeError(FailureKind.HTTP_ERROR, f"{path}: HTTP {code}: {snippet}", status_code=code)


def _snippet(response: httpx.Response) -> str:
    try:
        text = response.text
    except (httpx.HTTPError, UnicodeDecodeError):
        return "(unreadable body)"
    text = " ".join(text.split())
    return text[:BODY_SNIPPET_CHARS] + ("..." if len(text) > BODY_SNIPPET_CHARS else "")


def _decode_json(response: httpx.Response, path: str) -> Any:
    try:
        return response.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        ctype = response.headers.get("content-type", "?")
        raise ProbeError(
            FailureKind.NOT_JSON, f"{path}: the answer is not JSON (content-type {ctype}): {_snippet(response)}"
        ) from exc


def _transport_error(exc: httpx.HTTPError, url: str, timeout_s: float) -> ProbeError:
    if isinstance(exc, httpx.TimeoutException):
        return ProbeError(FailureKind.TIMEOUT, f"{url}: no answer within {timeout_s:g} s ({type(exc).__name__})")
    refused = netpolicy.refusal(exc)
    if refused:
        return ProbeError(FailureKind.NOT_ALLOWED, f"{url}: {refused}")
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ssl.SSLError):
            return ProbeError(FailureKind.TLS_ERROR, f"{url}: TLS error: {cause.reason or cause}")
        cause = cause.__cause__ or cause.__context__
    if isinstance(exc, httpx.ConnectError):
        detail = str(exc) or "connection failed"
        if "refused" in detail.lower():
            detail = "connection refused"
        return ProbeError(FailureKind.UNREACHABLE, f"{url}: {detail}")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.ReadError | httpx.WriteError):
        return ProbeError(FailureKind.UNREACHABLE, f"{url}: connection broken: {exc}")
    return ProbeError(FailureKind.UNREACHABLE, f"{url}: {type(exc).__name__}: {exc}")


Step = Callable[[ServerClient, dict[str, Any]], None]


def run_step(name: str, step: Step, client: ServerClient, caps: dict[str, Any], report: ProbeReport) -> bool:
    """Run one optional probing step; record its failure in report.errors. Returns whether it succeeded."""
    try:
        step(client, caps)
    except ProbeError as exc:
        report.errors.append(exc.as_record(name))
        return False
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        report.errors.append(shape_error(f"{name}: {type(exc).__name__}: {exc}").as_record(name))
        return False
    return True


@contextmanager
def shape_checked() -> Iterator[None]:
    """An answer the wire format cannot read is a WRONG_SHAPE probe error."""
    try:
        yield
    except WireError as exc:
        raise shape_error(str(exc)) from exc


def expect_dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise shape_error(f"{what} is {type(value).__name__}, expected an object")
    return value


def expect_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise shape_error(f"{what} is {type(value).__name__}, expected a list")
    return value


def expect_token_ids(value: Any, what: str) -> list[int]:
    ids = expect_list(value, what)
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise shape_error(f"{what} is not a non-empty list of integer token ids")
    return ids
