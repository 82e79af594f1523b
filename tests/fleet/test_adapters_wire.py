"""The request-time wire format of each server kind (fleet.adapters.wire): the requests it builds and how it reads
the answers, or the reason it refuses.

vLLM answers here have the shapes a real vLLM 0.32 returned (its real-server counterpart is
test_adapters_wire_vllm.py). SGLang does not run on this machine: its answers come from SGLang's own API
definitions (server_shapes.py: /generate, /tokenize; openai/protocol.py for /v1/completions), so these tests are
the only check of its wire format.
"""

from __future__ import annotations

import pytest

from fleet.adapters import Continued, Unsupported, WireError, wire_for
from fleet.adapters.wire import REQUESTS_RUNNING
from tests.support.server_shapes import fake_token_ids, sglang_generate, sglang_routes

VLLM = wire_for("vllm")
SGLANG = wire_for("sglang")
OPENAI = wire_for("openai")


class Posted:
    """The request object a server_shapes route reads (it calls .json())."""

    def __init__(self, body: dict) -> None:
        self.body = body

    def json(self) -> dict:
        return self.body


# --- vLLM ----------------------------------------------------------------------------------------------------------


def test_vllm_tokenizes_text_and_chat_messages_with_the_template():
    text = VLLM.tokenize(model="m", prompt="def f():")
    chat = VLLM.tokenize(model="m", messages=[{"role": "user", "content": "hi"}])
    assert (text.method, text.path, text.json) == ("POST", "/tokenize", {"model": "m", "prompt": "def f():"})
    assert chat.json == {"model": "m", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
    assert VLLM.parse_tokenize({"count": 2, "max_model_len": 1024, "tokens": [5, 6], "token_strs": None}) == [5, 6]
    with pytest.raises(WireError):
        VLLM.parse_tokenize({"tokens": ["a"]})


def test_vllm_detokenize_reads_the_prompt_key():
    assert VLLM.detokenize(model="m", token_ids=[1, 2]).json == {"model": "m", "tokens": [1, 2]}
    assert VLLM.parse_detokenize({"prompt": "ab"}) == "ab"
    with pytest.raises(WireError):
        VLLM.parse_detokenize({"text": "ab"})  # SGLang's key, not vLLM's


def vllm_scored(entries: list, generated: list[int]) -> dict:
    return {"choices": [{"index": 0, "text": "x", "token_ids": generated, "prompt_logprobs": entries}]}


def test_vllm_score_asks_prompt_logprobs_and_reads_ranks_the_own_token_and_the_greedy_token():
    request = VLLM.score(model="m", token_ids=[1, 2, 3], top_n=2)
    assert request.path == "/v1/completions"
    assert request.json == {
        "model": "m",
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "temperature": 0,
        "prompt_logprobs": 2,
        "return_token_ids": True,
    }
    entries = [
        None,
        {"2": {"logprob": -0.1, "rank": 1, "decoded_token": "b"}, "4": {"logprob": -3.0, "rank": 2}},
        {"7": {"logprob": -0.5, "rank": 1}, "8": {"logprob": -1.0, "rank": 2}, "3": {"logprob": -4.0, "rank": 9}},
    ]
    scored = VLLM.parse_score(vllm_scored(entries, [11]), token_ids=[1, 2, 3], top_n=2)
    assert scored.generated == [11]
    assert scored.positions[0] is None
    first, second = scored.positions[1], scored.positions[2]
    assert first.is_argmax(2) and first.argmax() == 2
    assert not second.is_argmax(3) and second.argmax() == 7
    assert [t.token_id for t in second.top] == [7, 8]  # the own token ranked 9th is not in the top 2
    assert second.rank_of(3) == 9
    assert second.logprobs() == {7: -0.5, 8: -1.0, 3: -4.0}


def test_vllm_score_without_logprobs_returns_only_the_greedy_token():
    assert VLLM.score(model="m", token_ids=[1], top_n=None).json["prompt_logprobs"] is None
    scored = VLLM.parse_score(vllm_scored(None, [4]), token_ids=[1], top_n=None)
    assert scored.generated == [4] and scored.positions == [None]


def test_vllm_score_refuses_an_answer_that_does_not_cover_the_sequence():
    with pytest.raises(WireError, match="2 entries, expected 3"):
        VLLM.parse_score(vllm_scored([None, {"2": {"logprob": -1.0, "rank": 1}}], [1]), token_ids=[1, 2, 3], top_n=1)


def test_vllm_score_reads_a_position_only_when_asked_and_refuses_a_malformed_one():
    entries = [None, {"two": {"logprob": -1.0}}, {"3": {"logprob": -0.5, "rank": 1}}]
    scored = VLLM.parse_score(vllm_scored(entries, [1]), token_ids=[1, 2, 3], top_n=1)
    assert scored.positions[2].argmax() == 3  # the remote path reads only the drafts' positions
    assert [p.argmax() for p in scored.positions[2:]] == [3]
    with pytest.raises(WireError, match="not a token id"):
        scored.positions[1]


def test_vllm_continuation_sends_token_ids_and_reads_stream_events():
    request = VLLM.continuation(
        model="m", token_ids=[1, 2], max_tokens=5, fields={"temperature": 0, "stop": ["\n"]}, stream=True
    )
    assert request.json == {
        "model": "m",
        "prompt": [1, 2],
        "max_tokens": 5,
        "temperature": 0,
        "stop": ["\n"],
        "stream": True,
        "return_token_ids": True,
    }
    event = {"choices": [{"index": 0, "text": "ab", "token_ids": [8, 9], "finish_reason": "stop", "stop_reason": 2}]}
    assert VLLM.parse_continuation(event) == Continued([8, 9], "ab", "stop", 2)
    assert VLLM.parse_continuation({"choices": [], "usage": {"completion_tokens": 2}}) is None


def test_vllm_baseline_ignores_the_end_of_sequence_and_reads_the_usage():
    request = VLLM.baseline(model="m", prompt=[1, 2], max_tokens=32)
    assert request.json == {"model": "m", "prompt": [1, 2], "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    assert VLLM.parse_baseline({"choices": [], "usage": {"completion_tokens": 32}}) == 32
    with pytest.raises(WireError):
        VLLM.parse_baseline({"choices": []})


def metrics(drafts: float, drafted: float, accepted: float, per_position: tuple[float, float]) -> str:
    """/metrics lines in the shape a real vLLM 0.32 with --speculative-config exposes."""
    labels = 'engine="0",model_name="m"'
    return "".join(
        [
            f"vllm:num_requests_running{{{labels}}} 2.0\n",
            f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}\n",
            f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {drafted}\n",
            f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}\n",
        ]
        + [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {n}\n'
            for i, n in enumerate(per_position)
        ]
    )


def test_vllm_spec_counters_come_from_metrics_with_the_running_requests():
    request = VLLM.spec_counters()
    assert (request.method, request.path) == ("GET", "/metrics")
    before = VLLM.parse_spec_counters(metrics(10, 40, 20, (12, 8)))
    after = VLLM.parse_spec_counters(metrics(20, 80, 40, (20, 12)))
    assert after[REQUESTS_RUNNING] == 2.0
    stats = VLLM.spec_stats(before, after)
    assert (stats["target_passes"], stats["drafted_tokens"], stats["accepted_tokens"]) == (10, 40, 20)
    assert stats["acceptance_rate"] == 0.5 and stats["mean_accepted_len"] == 3.0 and stats["k"] == 2
    assert stats["per_position_acceptance"] == [0.8, 0.4]


def test_vllm_reads_a_responses_own_speculation_metrics():
    payload = {
        "choices": [],
        "metrics": {
            "speculative_decoding": {
                "num_spec_steps": 4,
                "num_draft_tokens": 12,
                "num_accepted_draft_tokens": 6,
                "acceptance_histogram": [1, 1, 1, 1],
            }
        },
    }
    stats = VLLM.response_spec_stats(payload)
    assert stats["acceptance_rate"] == 0.5 and stats["mean_accepted_len"] == 2.5
    assert stats["per_position_acceptance"] == [0.75, 0.5, 0.25]
    assert VLLM.response_spec_stats({"choices": []}) is None


def test_vllm_token_ids_are_read_and_stripped_back_to_null():
    assert VLLM.token_ids_fields() == {"return_token_ids": True}
    payload = {
        "prompt_token_ids": [1, 2],  # chat: at the top level
        "choices": [
            {"index": 0, "text": "a", "token_ids": [5], "finish_reason": "length"},
            {"index": 1, "text": "b", "token_ids": [6]},
        ],
    }
    seen = VLLM.take_token_ids(payload, strip=True)
    assert (seen.prompt_ids, seen.output_ids, seen.finish_reason, seen.found) == ([1, 2], [5], "length", True)
    assert payload["prompt_token_ids"] is None and payload["choices"][0]["token_ids"] is None
    assert payload["choices"][1]["token_ids"] == [6]  # only choice 0 is measured (and stripped)


# --- SGLang (shapes from its API definitions) -----------------------------------------------------------------------


def test_sglang_scores_through_generate_from_the_first_token():
    ids = fake_token_ids("def fibonacci(n):")
    request = SGLANG.score(model="m", token_ids=ids, top_n=3)
    assert (request.method, request.path) == ("POST", "/generate")
    assert request.json["logprob_start_len"] == 0 and request.json["top_logprobs_num"] == 3
    assert request.json["sampling_params"] == {"max_new_tokens": 1, "temperature": 0}
    scored = SGLANG.parse_score(sglang_generate(Posted(request.json)), token_ids=ids, top_n=3)
    assert scored.generated == [7]
    assert scored.positions[0] is None and len(scored.positions) == len(ids)
    position = scored.positions[1]
    assert [(t.token_id, t.rank) for t in position.top] == [(0, 1), (1, 2), (2, 3)]
    assert position.argmax() == 0 and position.token.token_id == ids[1] and position.token.logprob == -1.5


def test_sglang_score_refuses_logprobs_of_other_tokens_than_the_sequence():
    ids = [5, 6, 7]
    answer = sglang_generate(Posted(SGLANG.score(model="m", token_ids=ids, top_n=1).json))
    scored = SGLANG.parse_score(answer, token_ids=[5, 6, 9], top_n=1)
    with pytest.raises(WireError, match="not 9"):
        scored.positions[2]


def test_sglang_tokenizes_text_but_refuses_chat_messages_with_a_reason():
    request = SGLANG.tokenize(model="m", prompt="hello", add_special_tokens=True)
    tokenize = sglang_routes()[("POST", "/tokenize")]
    assert SGLANG.parse_tokenize(tokenize(Posted(request.json))) == fake_token_ids("hello")
    with pytest.raises(Unsupported, match="chat template"):
        SGLANG.tokenize(model="m", messages=[{"role": "user", "content": "hi"}])
    detokenize = sglang_routes()[("POST", "/detokenize")]
    assert SGLANG.parse_detokenize(detokenize(Posted(SGLANG.detokenize(model="m", token_ids=[1, 2]).json))) == (
        "<decoded 2 tokens>"
    )


def test_sglang_continuation_reads_matched_stop_and_strips_absent_ids():
    event = {"choices": [{"index": 0, "text": "a", "token_ids": [3], "finish_reason": "stop", "matched_stop": "\n"}]}
    assert SGLANG.parse_continuation(event) == Continued([3], "a", "stop", "\n")
    payload = {"choices": [{"index": 0, "text": "a", "token_ids": [3], "prompt_token_ids": [1, 2]}]}
    seen = SGLANG.take_token_ids(payload, strip=True)
    assert (seen.prompt_ids, seen.output_ids) == ([1, 2], [3])
    assert payload["choices"][0] == {"index": 0, "text": "a"}  # SGLang omits the fields without the flag


def test_the_load_of_a_server_is_read_from_its_own_gauges():
    vllm = 'vllm:num_requests_running{engine="0"} 2.0\nvllm:num_requests_waiting{engine="0"} 1.0\nother 5\n'
    sglang = 'sglang:num_running_reqs{tp_rank="0"} 3.0\nsglang:num_queue_reqs{tp_rank="0"} 4.0\nsglang:x 0.5\n'
    assert VLLM.in_flight().path == SGLANG.in_flight().path == "/metrics"
    assert VLLM.parse_in_flight(vllm) == 3.0 and SGLANG.parse_in_flight(sglang) == 7.0
    assert VLLM.parse_in_flight(sglang) == 0.0  # another kind's gauges are not this kind's load
    with pytest.raises(Unsupported):
        OPENAI.in_flight()


def test_sglang_refuses_spec_counters_because_it_exports_only_averages():
    with pytest.raises(Unsupported, match="gauges"):
        SGLANG.spec_counters()
    assert SGLANG.response_spec_stats({"choices": []}) is None


# --- a generic OpenAI-compatible server ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("operation", "call", "why"),
    [
        ("tokenize", lambda: OPENAI.tokenize(model="m", prompt="x"), "no tokenize route"),
        ("detokenize", lambda: OPENAI.detokenize(model="m", token_ids=[1]), "no detokenize route"),
        ("score", lambda: OPENAI.score(model="m", token_ids=[1, 2], top_n=1), "keyed by token text"),
        (
            "continuation",
            lambda: OPENAI.continuation(model="m", token_ids=[1], max_tokens=1, fields={}, stream=False),
            "token ids it generated",
        ),
        ("spec_counters", lambda: OPENAI.spec_counters(), "does not say"),
        ("token_ids", lambda: OPENAI.token_ids_fields(), "token ids"),
    ],
)
def test_openai_compatible_refuses_what_the_api_cannot_say(operation, call, why):
    with pytest.raises(Unsupported, match=why) as refused:
        call()
    assert refused.value.operation == operation and refused.value.kind == "openai"


def test_openai_compatible_baseline_has_no_vllm_only_fields():
    request = OPENAI.baseline(model="m", prompt="x", max_tokens=8)
    assert request.json == {"model": "m", "prompt": "x", "max_tokens": 8, "temperature": 0}
    assert OPENAI.parse_baseline({"usage": {"completion_tokens": 3}}) == 3


def test_an_unknown_kind_gets_the_wire_that_refuses():
    assert wire_for("tgi") is OPENAI
