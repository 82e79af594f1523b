"""SGLang: native routes for server info, tokenizing and scoring; the OpenAI routes for models and streaming.

Shapes from SGLang's own API definitions (sgl-project/sglang, python/sglang/srt/entrypoints/http_server.py and
openai/serving_tokenize.py):
- GET /get_server_info (newer: /server_info) -> the server args (`speculative_algorithm`,
  `speculative_num_steps`, `speculative_num_draft_tokens`, `speculative_eagle_topk`, `context_length`, ...),
  the scheduler info (`max_req_input_len`, ...), `internal_states` and `version`.
- POST /tokenize {"model","prompt","add_special_tokens"} -> {"tokens","count","max_model_len"};
  POST /detokenize {"model","tokens"} -> {"text"}.
- POST /generate {"input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num",
  "sampling_params": {"max_new_tokens", "temperature"}} -> {"text", "meta_info": {"input_token_logprobs":
  [[logprob, token_id, text], ...], "input_top_logprobs": [null | [[logprob, token_id, text], ...], ...], ...}}
  and "output_ids" (the generated token ids).
- POST /v1/completions (openai/protocol.py CompletionRequest): token-id prompts, `return_token_ids` (then
  choices[i].token_ids, streamed incrementally, and prompt_token_ids; absent without the flag), `ignore_eos`,
  and `matched_stop` where vLLM says `stop_reason`.
- /metrics (with --enable-metrics) exports speculation only as gauges (`sglang:spec_accept_length`,
  `sglang:spec_accept_rate`: running averages), so no per-request acceptance can be derived from it; the load
  as gauges `sglang:num_running_reqs` and `sglang:num_queue_reqs`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fleet.adapters import semantics
from fleet.adapters.base import (
    FailureKind,
    ProbeError,
    ServerClient,
    expect_dict,
    shape_error,
)
from fleet.adapters.openai import FALLBACK_TOKEN_IDS, OpenAICompatibleAdapter
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
    is_int,
    sum_gauges,
)
from fleet.adapters.wire import expect_dict as expect_answer
from fleet.adapters.wire import expect_list as expect_answer_list

SERVER_INFO_PATHS = ("/get_server_info", "/server_info")


class SglangWire(OpenAICompletionsWithTokenIds):
    """SGLang at request time: its native /tokenize and /generate, its OpenAI completions with token ids."""

    kind: ClassVar[str] = "sglang"
    scoring_method: ClassVar[str | None] = "return_logprob"
    stop_reason_key: ClassVar[str] = "matched_stop"
    stripped_ids_absent: ClassVar[bool] = True
    refusals: ClassVar[dict[str, str]] = {
        "tokenize chat messages": "SGLang's /tokenize takes text only; it cannot apply the chat template to messages",
        "spec_counters": "SGLang exports speculation only as gauges of running averages "
        "(sglang:spec_accept_length), not counters a request's acceptance can be derived from",
    }

    def tokenize(
        self,
        *,
        model: str,
        prompt: str | None = None,
        messages: list[Any] | None = None,
        add_special_tokens: bool | None = None,
    ) -> WireRequest:
        if messages is not None:
            raise self.refuse("tokenize chat messages")
        body: dict[str, Any] = {"model": model, "prompt": prompt}
        if add_special_tokens is not None:
            body["add_special_tokens"] = add_special_tokens
        return WireRequest("POST", "/tokenize", body)

    def detokenize(self, *, model: str, token_ids: list[int]) -> WireRequest:
        return WireRequest("POST", "/detokenize", {"model": model, "tokens": list(token_ids)})

    def parse_detokenize(self, body: Any) -> str:
        text = body.get("text") if isinstance(body, dict) else None
        if not isinstance(text, str):
            raise WireError("/detokenize has no text string")
        return text

    def score(self, *, model: str, token_ids: list[int], top_n: int | None) -> WireRequest:
        """/generate from the first token (`logprob_start_len` 0) with `top_logprobs_num` N; one greedy token."""
        body: dict[str, Any] = {
            "input_ids": list(token_ids),
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        }
        if top_n is not None:
            body.update(return_logprob=True, logprob_start_len=0, top_logprobs_num=top_n)
        return WireRequest("POST", "/generate", body)

    def parse_score(self, body: Any, *, token_ids: list[int], top_n: int | None) -> Scored:
        answer = expect_answer(body, "/generate")
        generated = as_token_ids(answer.get("output_ids") or [], "/generate output_ids")
        if top_n is None:
            return Scored(positions=[None] * len(token_ids), generated=generated)
        meta = expect_answer(answer.get("meta_info"), "/generate meta_info")
        own = expect_answer_list(meta.get("input_token_logprobs"), "input_token_logprobs")
        top = expect_answer_list(meta.get("input_top_logprobs"), "input_top_logprobs")
        if len(own) != len(token_ids) or len(top) != len(token_ids):
            raise WireError(f"input logprobs cover {len(own)} / {len(top)} tokens, expected {len(token_ids)}")
        ids = list(token_ids)

        def parse(j: int) -> PositionScores | None:
            return _position(own[j], top[j], ids[j], j) if j else None

        return Scored(positions=LazyPositions(len(ids), parse), generated=generated)

    def in_flight(self) -> WireRequest:
        return WireRequest("GET", "/metrics")

    def parse_in_flight(self, text: str) -> float:
        return sum_gauges(text, ("sglang:num_running_reqs", "sglang:num_queue_reqs"))


def _position(own: Any, top: Any, token_id: int, j: int) -> PositionScores:
    """Position j from input_token_logprobs[j] (the sequence's own token) and input_top_logprobs[j] (the top-N,
    most likely first: their order is the rank SGLang does not state)."""
    ranked = tuple(
        TokenLogprob(token, logprob, rank)
        for rank, (logprob, token) in enumerate(_triples(top or [], "input_top_logprobs"), start=1)
    )
    ((logprob, token),) = _triples([own], "input_token_logprobs")
    if token != token_id:
        raise WireError(f"input_token_logprobs[{j}] scores token {token}, not {token_id}")
    rank = next((t.rank for t in ranked if t.token_id == token), None)
    return PositionScores(top=ranked, token=TokenLogprob(token, logprob, rank))


def _triples(entries: list[Any], what: str) -> list[tuple[float, int]]:
    """SGLang's [logprob, token_id, text] triples as (logprob, token id)."""
    pairs = []
    for entry in entries:
        if not isinstance(entry, list | tuple) or len(entry) < 2:
            raise WireError(f"{what} entries must be [logprob, token_id, text]")
        logprob, token = entry[0], entry[1]
        if not isinstance(logprob, int | float) or not is_int(token):
            raise WireError(f"{what} entries must be [logprob, token_id, text]")
        pairs.append((float(logprob), token))
    return pairs


class SglangAdapter(TokenizerRoutes, OpenAICompatibleAdapter):
    kind: ClassVar[str] = "sglang"
    semantics: ClassVar[RequestSemantics] = semantics.SGLANG
    wire: ClassVar[ServerWire] = SglangWire()

    def __init__(self, *, base_url: str, api_key: str = "", timeout_s: float) -> None:
        super().__init__(base_url=base_url, api_key=api_key, timeout_s=timeout_s)
        self._server_info: dict[str, Any] | None = None

    def _get_server_info(self, client: ServerClient) -> dict[str, Any]:
        if self._server_info is None:
            last: ProbeError | None = None
            for path in SERVER_INFO_PATHS:
                try:
                    self._server_info = expect_dict(client.get_json(path), path)
                    break
                except ProbeError as exc:
                    if exc.kind is not FailureKind.NOT_FOUND:
                        raise
                    last = exc
            else:
                raise last or ProbeError(FailureKind.NOT_FOUND, "no server info route")
        return self._server_info

    def discover_version(self, client: ServerClient, caps: dict[str, Any]) -> None:
        info = self._get_server_info(client)
        if isinstance(info.get("version"), str):
            caps["server_version"] = info["version"]
        if caps["max_context"] is None:
            for key in ("context_length", "max_req_input_len"):
                if isinstance(info.get(key), int) and info[key] > 0:
                    caps["max_context"] = info[key]
                    break

    def discover_native_speculation(self, client: ServerClient, caps: dict[str, Any]) -> None:
        info = self._get_server_info(client)
        if "speculative_algorithm" not in info:
            raise shape_error("server info has no speculative_algorithm")
        algorithm = info["speculative_algorithm"]
        caps["native_speculation_source"] = "server_info"
        caps["native_speculation"] = bool(algorithm)
        if not algorithm:
            return
        caps["native_speculation_method"] = str(algorithm).lower()
        steps = info.get("speculative_num_steps")
        caps["native_speculation_k"] = steps if isinstance(steps, int) else None
        caps["native_speculation_details"] = {
            key: info.get(key)
            for key in ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens")
        }

    def discover_token_id_prompts(self, client: ServerClient, caps: dict[str, Any]) -> None:
        ids = caps.get("canary_token_ids") or FALLBACK_TOKEN_IDS
        body = self._generate(client, {"input_ids": ids}, max_new_tokens=1)
        if not isinstance(body.get("text"), str):
            raise shape_error("/generate has no text")
        caps["token_id_prompts"] = True

    def discover_prompt_scoring(self, client: ServerClient, caps: dict[str, Any]) -> None:
        self._largest_accepted(caps, "return_logprob", lambda n: self.score_canary(client, caps, n))

    def _generate(self, client: ServerClient, fields: dict[str, Any], *, max_new_tokens: int) -> dict[str, Any]:
        body = {**fields, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        return expect_dict(client.post_json("/generate", body), "/generate")
