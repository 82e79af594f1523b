"""The OpenAI-compatible adapter, and the probing sequence every adapter shares.

A server kind changes how a step is asked (its own routes and fields), never which steps there are: the
subclasses for vLLM and SGLang override steps, not the sequence.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

from fleet.adapters import semantics
from fleet.adapters.base import (
    CANARY_TEXT,
    CANARY_VERSION,
    LATENCY_MAX_TOKENS,
    LATENCY_PROMPT,
    LOGPROBS_CANDIDATES,
    REFERENCE_TOKENS,
    REFERENCE_TOP_N,
    FailureKind,
    ProbeError,
    ProbeReport,
    ServerClient,
    Step,
    expect_dict,
    expect_list,
    run_step,
    shape_checked,
    shape_error,
)
from fleet.adapters.semantics import RequestSemantics
from fleet.adapters.wire import ServerWire, Unsupported, WireRequest
from fleet.netpolicy import URLNotAllowed, check_url

logger = logging.getLogger(__name__)

# Token ids used to test token-id prompts when the server cannot tokenize the canary for us: small ids exist in
# every vocabulary.
FALLBACK_TOKEN_IDS = [10, 11, 12, 13, 14, 15, 16, 17]
# A slow server must not hold a worker for minutes: optional steps stop once this many timeouts have passed.
PROBE_BUDGET_TIMEOUTS = 4


def empty_capabilities(kind: str) -> dict[str, Any]:
    return {
        "server_kind": kind,
        "server_version": None,
        "models": [],
        "served_model": "",
        "max_context": None,
        "tokenize": False,
        "detokenize": False,
        "token_id_prompts": False,
        "prompt_scoring": False,
        "prompt_scoring_method": None,
        "max_logprobs": None,
        "tokenizer_fingerprint": None,
        "canary_token_ids": None,
        "canary_version": CANARY_VERSION,
        "canary_reference": None,
        "native_speculation": None,
        "native_speculation_method": None,
        "native_speculation_k": None,
        "native_speculation_source": None,
        "ttft_ms": None,
        "tpot_ms": None,
        "latency_output_tokens": None,
    }


class OpenAIWire(ServerWire):
    """The OpenAI completions API at request time: only a plain generation (the baseline) is defined by it."""

    kind: ClassVar[str] = "openai"
    refusals: ClassVar[dict[str, str]] = {
        "tokenize": "the OpenAI API has no tokenize route",
        "detokenize": "the OpenAI API has no detokenize route",
        "score": "the OpenAI API scores a prompt only with echo + logprobs, keyed by token text, not token ids",
        "continuation": "the OpenAI API does not return the token ids it generated",
        "spec_counters": "the OpenAI API does not say whether or how the server speculates",
        "token_ids": "the OpenAI API does not return a response's token ids",
        "in_flight": "the OpenAI API does not say how many requests the server runs",
    }

    def baseline(self, *, model: str, prompt: str | list[int], max_tokens: int) -> WireRequest:
        """No `ignore_eos` in the OpenAI API: the rate is over the tokens the server chose to generate."""
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return WireRequest("POST", "/v1/completions", body)


class OpenAICompatibleAdapter:
    """Any server speaking the OpenAI completions API: models, token-id prompts, echo+logprobs scoring, streaming."""

    kind: ClassVar[str] = "openai"
    semantics: ClassVar[RequestSemantics] = semantics.OPENAI
    wire: ClassVar[ServerWire] = OpenAIWire()

    def __init__(self, *, base_url: str, api_key: str = "", timeout_s: float) -> None:
        self.base_url = base_url.rstrip("/")
        self._api_key = api_key
        self.timeout_s = timeout_s

    def __repr__(self) -> str:  # never shows the key
        return f"{type(self).__name__}(base_url={self.base_url!r})"

    # --- the sequence -------------------------------------------------------------------------------------------

    def probe(self) -> ProbeReport:
        report = ProbeReport(capabilities=empty_capabilities(self.kind))
        try:
            check_url(self.base_url)  # again at connect time: DNS may have changed since registration
        except URLNotAllowed as exc:
            return self._fail(report, "network_policy", ProbeError(FailureKind.NOT_ALLOWED, str(exc)))
        try:
            with ServerClient(self.base_url, api_key=self._api_key, timeout_s=self.timeout_s) as client:
                if not run_step("models", self.discover_models, client, report.capabilities, report):
                    report.fatal = _as_error(report.errors[-1])
                    return report
                deadline = time.monotonic() + PROBE_BUDGET_TIMEOUTS * self.timeout_s
                for name, step in self.optional_steps():
                    if time.monotonic() > deadline:
                        message = f"skipped: the probe's time budget ({PROBE_BUDGET_TIMEOUTS} x timeout) is spent"
                        report.errors.append(ProbeError(FailureKind.TIMEOUT, message).as_record(name))
                        continue
                    run_step(name, step, client, report.capabilities, report)
        except Exception as exc:  # never crash the worker: record it and keep the trace in the log
            logger.exception("probe of %s failed unexpectedly", self.base_url)
            return self._fail(report, "internal", ProbeError(FailureKind.INTERNAL, f"internal error: {exc!r}"))
        return report

    def optional_steps(self) -> list[tuple[str, Step]]:
        return [
            ("version", self.discover_version),
            ("tokenize", self.discover_tokenizer),
            ("detokenize", self.discover_detokenize),
            ("token_id_prompts", self.discover_token_id_prompts),
            ("prompt_scoring", self.discover_prompt_scoring),
            ("canary_reference", self.record_canary_reference),
            ("native_speculation", self.discover_native_speculation),
            ("latency", self.measure_latency),
        ]

    @staticmethod
    def _fail(report: ProbeReport, step: str, error: ProbeError) -> ProbeReport:
        report.errors.append(error.as_record(step))
        report.fatal = error
        return report

    # --- steps -------------------------------------------------------------------------------------------------

    def discover_models(self, client: ServerClient, caps: dict[str, Any]) -> None:
        body = expect_dict(client.get_json("/v1/models"), "/v1/models")
        cards = expect_list(body.get("data"), "/v1/models data")
        ids = [expect_dict(card, "a model card")["id"] for card in cards]
        if not ids or not all(isinstance(i, str) and i for i in ids):
            raise shape_error("/v1/models lists no model id")
        caps["models"] = ids
        caps["served_model"] = ids[0]
        first = cards[0]
        for key in ("max_model_len", "context_length", "context_window"):
            if isinstance(first.get(key), int) and first[key] > 0:
                caps["max_context"] = first[key]
                break

    def discover_version(self, client: ServerClient, caps: dict[str, Any]) -> None:
        """The OpenAI API has no version route; the kind-specific adapters know where to look."""

    def discover_tokenizer(self, client: ServerClient, caps: dict[str, Any]) -> None:
        """The OpenAI API cannot tokenize: tokenize stays False and there is no fingerprint."""

    def discover_detokenize(self, client: ServerClient, caps: dict[str, Any]) -> None:
        """The OpenAI API cannot detokenize."""

    def discover_token_id_prompts(self, client: ServerClient, caps: dict[str, Any]) -> None:
        ids = caps.get("canary_token_ids") or FALLBACK_TOKEN_IDS
        body = self.completion(client, caps, prompt=ids, max_tokens=1)
        expect_list(body.get("choices"), "completion choices")[0]
        caps["token_id_prompts"] = True

    def discover_prompt_scoring(self, client: ServerClient, caps: dict[str, Any]) -> None:
        """OpenAI legacy completions: echo=true + logprobs=N returns the prompt tokens' logprobs."""
        self._largest_accepted(caps, "echo_logprobs", lambda n: self._score_with_echo(client, caps, n))

    def discover_native_speculation(self, client: ServerClient, caps: dict[str, Any]) -> None:
        """A plain OpenAI-compatible server does not say whether it speculates: native_speculation stays None."""

    def record_canary_reference(self, client: ServerClient, caps: dict[str, Any]) -> None:
        """The served model's own answers on the canary's token ids: its greedy continuation, then its top
        log-probabilities over canary and continuation (one scoring call). A server kind that cannot continue token
        ids leaves the reference None; one that cannot score them records the greedy continuation alone."""
        ids = caps.get("canary_token_ids")
        if not ids:
            return
        model = caps["served_model"]
        try:
            request = self.wire.continuation(
                model=model, token_ids=ids, max_tokens=REFERENCE_TOKENS, fields={"temperature": 0}, stream=False
            )
        except Unsupported:
            return
        with shape_checked():
            continued = self.wire.parse_continuation(client.send(request))
        sequence = [*ids, *(continued.token_ids if continued else [])]
        reference: dict[str, Any] = {"token_ids": sequence, "prompt_len": len(ids), "top_logprobs": None}
        top_n = min(int(caps.get("max_logprobs") or 0), REFERENCE_TOP_N)
        if not top_n or caps.get("prompt_scoring_method") != self.wire.scoring_method:
            reference["greedy_only"] = "the server does not score token-id prompts with top log-probabilities"
        else:
            body = client.send(self.wire.score(model=model, token_ids=sequence, top_n=top_n))
            with shape_checked():
                positions = self.wire.parse_score(body, token_ids=sequence, top_n=top_n).positions
                reference["top_logprobs"] = [
                    None if p is None else [[t.token_id, t.logprob] for t in p.top] for p in positions
                ]
        if continued and continued.token_ids or reference["top_logprobs"]:  # else nothing a local model could match
            caps["canary_reference"] = reference

    def measure_latency(self, client: ServerClient, caps: dict[str, Any]) -> None:
        body = {
            "model": caps["served_model"],
            "prompt": LATENCY_PROMPT,
            "max_tokens": LATENCY_MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.latency_extra_fields(),
        }
        start = time.perf_counter()
        token_times: list[float] = []
        usage_tokens: int | None = None
        for at, event in client.stream_events("/v1/completions", body):
            choices = event.get("choices") or []
            if choices and isinstance(choices[0], dict) and choices[0].get("text") is not None:
                token_times.append(at)
            usage = event.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                usage_tokens = usage["completion_tokens"]
        if not token_times:
            raise shape_error("the streamed completion carried no token")
        tokens = usage_tokens or len(token_times)
        caps["ttft_ms"] = round((token_times[0] - start) * 1000, 3)
        caps["latency_output_tokens"] = tokens
        if tokens > 1:
            caps["tpot_ms"] = round((token_times[-1] - token_times[0]) * 1000 / (tokens - 1), 3)

    # --- helpers shared by the adapters --------------------------------------------------------------------------

    def latency_extra_fields(self) -> dict[str, Any]:
        return {}

    def completion(self, client: ServerClient, caps: dict[str, Any], **fields: Any) -> dict[str, Any]:
        body = {"model": caps["served_model"], "temperature": 0, **fields}
        return expect_dict(client.post_json("/v1/completions", body), "/v1/completions")

    def score_canary(self, client: ServerClient, caps: dict[str, Any], n: int) -> None:
        """Score the canary's token ids through the wire format; WRONG_SHAPE unless the top n came back."""
        ids = caps.get("canary_token_ids") or FALLBACK_TOKEN_IDS
        body = client.send(self.wire.score(model=caps["served_model"], token_ids=ids, top_n=n))
        with shape_checked():
            scored = self.wire.parse_score(body, token_ids=ids, top_n=n)
        position = scored.positions[1] if len(scored.positions) > 1 else None
        got = len(position.top) if position is not None else 0
        if got < n:
            raise shape_error(f"asked for {n} top log-probabilities per prompt token, got {got}")

    def _score_with_echo(self, client: ServerClient, caps: dict[str, Any], n: int) -> None:
        body = self.completion(client, caps, prompt=CANARY_TEXT, max_tokens=1, echo=True, logprobs=n)
        choice = expect_dict(expect_list(body.get("choices"), "choices")[0], "a choice")
        logprobs = expect_dict(choice.get("logprobs"), "choice logprobs")
        token_logprobs = expect_list(logprobs.get("token_logprobs"), "token_logprobs")
        top = expect_list(logprobs.get("top_logprobs"), "top_logprobs")
        if len(token_logprobs) < 2 or not any(isinstance(v, int | float) for v in token_logprobs[:-1]):
            raise shape_error("echo returned no prompt logprobs")
        scored = [t for t in top[:-1] if isinstance(t, dict)]
        if n > 1 and scored and max(len(t) for t in scored) < min(n, 2):
            raise shape_error(f"asked for {n} top logprobs, got fewer")

    @staticmethod
    def _largest_accepted(caps: dict[str, Any], method: str, attempt: Any) -> None:
        """Try each count in LOGPROBS_CANDIDATES, largest first; record the first one the server accepts."""
        last: ProbeError | None = None
        for n in LOGPROBS_CANDIDATES:
            try:
                attempt(n)
            except ProbeError as exc:
                if exc.kind in (FailureKind.HTTP_ERROR, FailureKind.WRONG_SHAPE):
                    last = exc
                    continue
                raise
            caps["prompt_scoring"] = True
            caps["prompt_scoring_method"] = method
            caps["max_logprobs"] = n
            return
        raise last or ProbeError(FailureKind.UNSUPPORTED, "prompt scoring refused")


def _as_error(record: dict[str, Any]) -> ProbeError:
    return ProbeError(FailureKind(record["kind"]), record["message"], status_code=record.get("status_code"))
