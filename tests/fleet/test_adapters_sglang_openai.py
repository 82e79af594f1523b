"""The SGLang and OpenAI-compatible adapters against their servers' response shapes (loopback stub servers).

SGLang cannot run on this machine; the shapes come from SGLang's own API definitions
(see tests/support/server_shapes.py).
The vLLM adapter, and the OpenAI-compatible adapter against a real server, are in test_probing_vllm.py.
"""

from __future__ import annotations

import pytest

from fleet.adapters import CANARY_TEXT, FailureKind, adapter_for, fingerprint
from fleet.models import EndpointStatus
from fleet.probing import summarize
from tests.support.server_shapes import MODEL, fake_token_ids, openai_routes, sglang_routes


def test_sglang_probe_records_every_capability(http_stub):
    stub = http_stub(sglang_routes())
    report = adapter_for("sglang", base_url=stub.base_url).probe()
    caps = report.capabilities
    assert report.errors == []
    assert summarize(report)[0] == EndpointStatus.READY
    assert caps["served_model"] == MODEL
    assert caps["max_context"] == 2048  # the model card wins over the server's context_length
    assert caps["server_version"] == "0.5.4"
    assert caps["tokenize"] and caps["detokenize"] and caps["token_id_prompts"]
    assert caps["canary_token_ids"] == fake_token_ids(CANARY_TEXT)
    assert caps["tokenizer_fingerprint"] == fingerprint(fake_token_ids(CANARY_TEXT))
    assert caps["prompt_scoring"] is True
    assert caps["prompt_scoring_method"] == "return_logprob"
    assert caps["max_logprobs"] == 20
    assert caps["native_speculation"] is False
    assert caps["native_speculation_source"] == "server_info"
    assert caps["ttft_ms"] > 0 and caps["tpot_ms"] >= 0 and caps["latency_output_tokens"] == 16


def test_sglang_scoring_asks_for_prompt_logprobs_from_the_first_token(http_stub):
    stub = http_stub(sglang_routes())
    adapter_for("sglang", base_url=stub.base_url).probe()
    scoring = [r.json() for r in stub.requests if r.path == "/generate" and r.json().get("return_logprob")]
    assert scoring[0]["logprob_start_len"] == 0
    assert scoring[0]["top_logprobs_num"] == 20
    assert scoring[0]["input_ids"] == fake_token_ids(CANARY_TEXT)


@pytest.mark.parametrize("info_path", ["/get_server_info", "/server_info"])
def test_sglang_native_speculation_is_read_from_server_info(http_stub, info_path):
    stub = http_stub(sglang_routes(speculative_algorithm="EAGLE3", info_path=info_path))
    caps = adapter_for("sglang", base_url=stub.base_url).probe().capabilities
    assert caps["native_speculation"] is True
    assert caps["native_speculation_method"] == "eagle3"
    assert caps["native_speculation_k"] == 3
    assert caps["native_speculation_details"]["speculative_num_draft_tokens"] == 4


def test_sglang_without_server_info_still_probes_and_says_why(http_stub):
    routes = sglang_routes()
    del routes[("GET", "/get_server_info")]
    stub = http_stub(routes)
    report = adapter_for("sglang", base_url=stub.base_url).probe()
    assert summarize(report)[0] == EndpointStatus.READY
    assert report.capabilities["native_speculation"] is None
    assert {e["step"] for e in report.errors} == {"version", "native_speculation"}
    assert all(e["kind"] == FailureKind.NOT_FOUND for e in report.errors)


def test_openai_compatible_probe_uses_echo_logprobs_and_finds_the_largest_count(http_stub):
    stub = http_stub(openai_routes(max_logprobs=5))
    report = adapter_for("openai", base_url=stub.base_url).probe()
    caps = report.capabilities
    assert report.errors == []
    assert caps["prompt_scoring_method"] == "echo_logprobs"
    assert caps["max_logprobs"] == 5  # 20 and 10 were refused with HTTP 400
    assert caps["token_id_prompts"] is True
    assert caps["tokenize"] is False and caps["tokenizer_fingerprint"] is None
    assert caps["native_speculation"] is None  # a plain OpenAI server does not say
    assert caps["max_context"] == 2048
