"""vLLM: /version, /tokenize, /detokenize, `prompt_logprobs` scoring, and spec-decode counters in /metrics.

Shapes as a real vLLM 0.32 answers them (see shared/ANCHORS.md section 5):
- POST /tokenize {"model","prompt"} -> {"count","max_model_len","tokens","token_strs"}
- POST /detokenize {"model","tokens"} -> {"prompt"}
- POST /v1/completions with "prompt_logprobs": N -> choices[0].prompt_logprobs = [null, {"<id>": {"logprob",...}}, ...]
  (N above --max-logprobs, default 20, is refused with HTTP 400)
- /metrics carries vllm:spec_decode_* counters only when the server runs speculative decoding, with one
  vllm:spec_decode_num_accepted_tokens_per_pos series per draft position (so K = number of positions).
- GET /server_info?config_format=json exists only with VLLM_SERVER_DEV_MODE=1; it names the method.
"""

from __future__ import annotations

from typing import Any, ClassVar

from fleet.adapters import semantics, vllm_metrics
from fleet.adapters.base import (
    CANARY_TEXT,
    FailureKind,
    ProbeError,
    ServerClient,
    expect_dict,
    expect_list,
    shape_error,
)
from fleet.adapters.openai import OpenAICompatibleAdapter
from fleet.adapters.semantics import RequestSemantics
from fleet.adapters.tokenizer_routes import TokenizerRoutes

# /server_info collects the host's environment on its first call (about 9 s on a busy 2-core machine).
SERVER_INFO_TIMEOUTS = 3


class VllmAdapter(TokenizerRoutes, OpenAICompatibleAdapter):
    kind: ClassVar[str] = "vllm"
    semantics: ClassVar[RequestSemantics] = semantics.VLLM
    detokenized_key: ClassVar[str] = "prompt"

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
        """vLLM's own `prompt_logprobs`; OpenAI echo+logprobs only if that is refused."""
        try:
            self._largest_accepted(caps, "prompt_logprobs", lambda n: self._score_with_prompt_logprobs(client, caps, n))
        except ProbeError:
            super().discover_prompt_scoring(client, caps)

    def _score_with_prompt_logprobs(self, client: ServerClient, caps: dict[str, Any], n: int) -> None:
        prompt: Any = caps.get("canary_token_ids") or CANARY_TEXT
        body = self.completion(client, caps, prompt=prompt, max_tokens=1, prompt_logprobs=n)
        choice = expect_dict(expect_list(body.get("choices"), "choices")[0], "a choice")
        positions = expect_list(choice.get("prompt_logprobs"), "prompt_logprobs")
        if len(positions) < 2 or positions[0] is not None:
            raise shape_error("prompt_logprobs must start with null and cover the prompt")
        entry = expect_dict(positions[1], "a prompt_logprobs entry")
        first = expect_dict(next(iter(entry.values())), "a prompt logprob")
        if not isinstance(first.get("logprob"), int | float) or not all(k.lstrip("-").isdigit() for k in entry):
            raise shape_error("prompt_logprobs entries must map token ids to {logprob}")
        if len(entry) < n:
            raise shape_error(f"asked for {n} prompt logprobs, got {len(entry)}")

    def discover_native_speculation(self, client: ServerClient, caps: dict[str, Any]) -> None:
        counters = vllm_metrics.parse_spec_counters(client.get_text("/metrics"))
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
