"""vLLM: /version, /tokenize, /detokenize, `prompt_logprobs` scoring, and spec-decode counters in /metrics.

Shapes as a real vLLM 0.32 answers them (see shared/ANCHORS.md section 5):
- POST /tokenize {"model","prompt"} -> {"count","max_model_len","tokens","token_strs"}
- POST /detokenize {"model","tokens"} -> {"prompt"}
- POST /v1/completions with "prompt_logprobs": N -> choices[0].prompt_logprobs = [null, {"<id>": {"logprob",...}}, ...]
  (N above --max-logprobs, default 20, is refused with HTTP 400)
- /metrics carries vllm:spec_decode_* counters only when the server runs speculative decoding, with one
  vllm:spec_decode_num_accepted_tokens_per_pos series per draft position (so K = number of positions).
- GET /server_info?config_format=json exists only with VLLM_SERVER_DEV_MODE=1; it names the method.
- POST /tokenize {"model","messages","add_generation_prompt"} applies the chat template first.
- POST /v1/completions with "return_token_ids": true -> choices[0].token_ids (and prompt_token_ids; a chat
  response has prompt_token_ids at the top level); without the flag both are null.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fleet.adapters import semantics, vllm_metrics
from fleet.adapters.base import (
    FailureKind,
    ProbeError,
    ServerClient,
    expect_dict,
    shape_error,
)
from fleet.adapters.openai import OpenAICompatibleAdapter
from fleet.adapters.semantics import RequestSemantics
from fleet.adapters.tokenizer_routes import TokenizerRoutes
from fleet.adapters.wire import (
    LazyPositions,
    OpenAICompletionsWithTokenIds,
    PositionScores,
    Scored,
    ServerWire,
    TokenLogprob,
    WireError,
    WireRequest,
    as_token_ids,
    first_choice,
    is_int,
    ranked_top,
    sum_gauges,
)

# /server_info collects the host's environment on its first call (about 9 s on a busy 2-core machine).
SERVER_INFO_TIMEOUTS = 3
# What a server that does not offer prompt_logprobs answers (then the OpenAI echo+logprobs route is tried).
REFUSED = (FailureKind.HTTP_ERROR, FailureKind.WRONG_SHAPE, FailureKind.NOT_FOUND, FailureKind.UNSUPPORTED)


class VllmWire(OpenAICompletionsWithTokenIds):
    """vLLM at request time: every operation."""

    kind: ClassVar[str] = "vllm"
    scoring_method: ClassVar[str | None] = "prompt_logprobs"

    def tokenize(
        self,
        *,
        model: str,
        prompt: str | None = None,
        messages: list[Any] | None = None,
        add_special_tokens: bool | None = None,
    ) -> WireRequest:
        body: dict[str, Any] = {"model": model}
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=True)  # the chat template, as the server applies it
        else:
            body["prompt"] = prompt
        if add_special_tokens is not None:
            body["add_special_tokens"] = add_special_tokens
        return WireRequest("POST", "/tokenize", body)

    def detokenize(self, *, model: str, token_ids: list[int]) -> WireRequest:
        return WireRequest("POST", "/detokenize", {"model": model, "tokens": list(token_ids)})

    def parse_detokenize(self, body: Any) -> str:
        text = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise WireError("/detokenize has no prompt string")
        return text

    def score(self, *, model: str, token_ids: list[int], top_n: int | None) -> WireRequest:
        """`prompt_logprobs: N` scores every prompt token (vLLM skips its prefix cache for it); max_tokens 1 at
        temperature 0 generates the greedy next token."""
        body = {
            "model": model,
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0,
            "prompt_logprobs": top_n,
            "return_token_ids": True,
        }
        return WireRequest("POST", "/v1/completions", body)

    def parse_score(self, body: Any, *, token_ids: list[int], top_n: int | None) -> Scored:
        choice = first_choice(body, "/v1/completions")
        generated = as_token_ids(choice.get("token_ids") or [], "token_ids")
        if top_n is None:
            return Scored(positions=[None] * len(token_ids), generated=generated)
        entries = choice.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(token_ids):
            found = len(entries) if isinstance(entries, list) else type(entries).__name__
            raise WireError(f"prompt_logprobs has {found} entries, expected {len(token_ids)}")
        ids = list(token_ids)

        def parse(j: int) -> PositionScores | None:
            return _position(entries[j], ids[j], top_n) if j else None

        return Scored(positions=LazyPositions(len(entries), parse), generated=generated)

    def spec_counters(self) -> WireRequest:
        return WireRequest("GET", "/metrics")

    def parse_spec_counters(self, text: str) -> dict[str, float]:
        counters = vllm_metrics.parse_spec_counters(text)
        counters[vllm_metrics.RUNNING] = vllm_metrics.requests_running(text)
        return counters

    def spec_stats(self, before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
        return vllm_metrics.stats_from_deltas(before, after)

    def in_flight(self) -> WireRequest:
        return WireRequest("GET", "/metrics")

    def parse_in_flight(self, text: str) -> float:
        return sum_gauges(text, ("vllm:num_requests_running", "vllm:num_requests_waiting"))

    def response_spec_stats(self, payload: Any) -> dict[str, Any] | None:
        """`metrics.speculative_decoding` (vLLM 0.32 with --per-request-spec-decode-metrics)."""
        metrics = payload.get("metrics") if isinstance(payload, dict) else None
        spec = metrics.get("speculative_decoding") if isinstance(metrics, dict) else None
        return vllm_metrics.stats_from_request_metrics(spec) if isinstance(spec, dict) else None


def _position(entry: Any, token_id: int, top_n: int) -> PositionScores:
    """One prompt_logprobs entry, {"<token id>": {"logprob", "rank", "decoded_token"}}: the top-N by rank and the
    prompt's own token (with its rank, wherever it ranks)."""
    if not isinstance(entry, dict):
        raise WireError("a prompt_logprobs entry is not an object")
    parsed: list[TokenLogprob] = []
    for key, value in entry.items():
        if not isinstance(value, dict) or not isinstance(value.get("logprob"), int | float):
            raise WireError("prompt_logprobs entries must map token ids to {logprob, rank}")
        try:
            token = int(key)
        except ValueError:
            raise WireError(f"prompt_logprobs key {key!r} is not a token id") from None
        rank = value.get("rank")
        parsed.append(TokenLogprob(token, float(value["logprob"]), rank if is_int(rank) else None))
    own = next((t for t in parsed if t.token_id == token_id), None)
    return PositionScores(top=ranked_top(parsed, top_n), token=own)


class VllmAdapter(TokenizerRoutes, OpenAICompatibleAdapter):
    kind: ClassVar[str] = "vllm"
    semantics: ClassVar[RequestSemantics] = semantics.VLLM
    wire: ClassVar[ServerWire] = VllmWire()

    def discover_version(self, client: ServerClient, caps: dict[str, Any]) -> None:
        body = expect_dict(client.get_json("/version"), "/version")
        if not isinstance(body.get("version"), str):
            raise shape_error("/version has no version string")
        caps["server_version"] = body["version"]

    def discover_tokenizer(self, client: ServerClient, caps: dict[str, Any]) -> dict[str, Any]:
        body = super().discover_tokenizer(client, caps)
        if caps["max_context"] is None and isinstance(body.get("max_model_len"), int):
            caps["max_context"] = body["max_model_len"]
        return body

    def discover_prompt_scoring(self, client: ServerClient, caps: dict[str, Any]) -> None:
        """vLLM's own `prompt_logprobs`; OpenAI echo+logprobs only if that is refused (a timeout or a broken
        connection is recorded as this step's failure, not taken for a refusal)."""
        try:
            self._largest_accepted(caps, "prompt_logprobs", lambda n: self.score_canary(client, caps, n))
        except ProbeError as exc:
            if exc.kind not in REFUSED:
                raise
            super().discover_prompt_scoring(client, caps)

    def discover_native_speculation(self, client: ServerClient, caps: dict[str, Any]) -> None:
        counters = self.wire.parse_spec_counters(client.get_text(self.wire.spec_counters().path))
        enabled = vllm_metrics.speculates(counters)
        caps["native_speculation"] = enabled
        caps["native_speculation_source"] = "metrics"
        if not enabled:
            return
        positions = vllm_metrics.positions(counters)
        caps["native_speculation_k"] = max(positions) + 1 if positions else None
        caps["native_speculation_method"] = self._speculative_method(client, caps)

    def _speculative_method(self, client: ServerClient, caps: dict[str, Any]) -> str | None:
        """Only a server started with VLLM_SERVER_DEV_MODE=1 says which method it runs; others leave it None."""
        try:
            answer = client.get_json(
                "/server_info", params={"config_format": "json"}, timeout_s=SERVER_INFO_TIMEOUTS * self.timeout_s
            )
            info = expect_dict(answer, "/server_info")
        except ProbeError as exc:
            if exc.kind is FailureKind.NOT_FOUND:
                return None
            raise
        config = expect_dict(info.get("vllm_config"), "/server_info vllm_config")
        spec = config.get("speculative_config")
        if not isinstance(spec, dict):
            return None
        if isinstance(spec.get("num_speculative_tokens"), int):
            caps["native_speculation_k"] = spec["num_speculative_tokens"]
        caps["native_speculation_source"] = "metrics+server_info"
        method = spec.get("method")
        return method if isinstance(method, str) else None

    def latency_extra_fields(self) -> dict[str, Any]:
        # Generate the full budget even if the model would stop early, so TPOT averages over several tokens.
        return {"ignore_eos": True}
