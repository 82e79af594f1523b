"""Gateway pieces that need no server: which requests prod serves exactly, SSE framing, vLLM counter parsing,
and shadow's token-id stripping (on bytes captured from a real vLLM 0.32 answer)."""

from __future__ import annotations

import pytest

from fleet.adapters import wire_for
from fleet.adapters.vllm_metrics import parse_spec_counters, stats_from_deltas
from speculation.gateway.exactness import stop_fields_reason, unservable_reason
from speculation.gateway.sse import EventSplitter, payload_of

GREEDY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 8}


def test_a_greedy_chat_request_is_served_exactly():
    assert unservable_reason(GREEDY, kind="chat") == ""
    assert unservable_reason({**GREEDY, "stream": True, "stream_options": {"include_usage": True}}, kind="chat") == ""


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"temperature": None}, "temperature not given"),
        ({"n": 2}, "n > 1"),
        ({"logprobs": True}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"skip_special_tokens": False}, "unsupported parameter skip_special_tokens"),
        ({"response_format": {"type": "json_object"}}, "unsupported parameter response_format"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_requests_prod_cannot_serve_exactly_say_why(extra, reason):
    assert reason in unservable_reason({**GREEDY, **extra}, kind="chat")


def test_stop_fields_are_served_where_the_worker_applies_them_exactly():
    fields = {"stop": ["\n", "def "], "stop_token_ids": [2], "min_tokens": 3, "ignore_eos": True}
    body = {**GREEDY, **fields, "include_stop_str_in_output": True, "n": 1}
    assert unservable_reason(body, kind="chat") == ""
    assert stop_fields_reason(body, kind="chat", path="local") == ""
    completion = {"model": "m", "prompt": "x", "temperature": 0, "echo": True, "stop": "\n"}
    assert stop_fields_reason(completion, kind="completion", path="remote") == ""


@pytest.mark.parametrize(
    ("body", "kind", "path", "reason"),
    [
        ({"min_tokens": 2}, "chat", "remote", "min_tokens on the remote path"),
        ({"echo": True}, "chat", "local", "echo on chat"),
        ({"echo": True, "prompt": [1, 2]}, "completion", "local", "token-id prompt"),
        ({"stop": ["a", ""]}, "chat", "local", "empty string"),
        ({"stop": [1]}, "chat", "local", "stop must be"),
        ({"stop_token_ids": ["x"]}, "chat", "local", "stop_token_ids"),
        ({"min_tokens": -1}, "chat", "local", "min_tokens"),
    ],
)
def test_stop_fields_prod_cannot_apply_exactly_say_why(body, kind, path, reason):
    assert reason in stop_fields_reason(body, kind=kind, path=path)


def test_a_batch_of_prompts_is_not_served():
    body = {"model": "m", "prompt": ["a", "b"], "temperature": 0}
    assert "batch" in unservable_reason(body, kind="completion")
    assert unservable_reason({**body, "prompt": [1, 2, 3]}, kind="completion") == ""


def test_events_split_across_chunks_come_out_whole():
    splitter = EventSplitter()
    assert splitter.feed(b'data: {"a":') == []
    events = splitter.feed(b" 1}\n\ndata: [DONE]\n\n")
    assert events == [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]
    assert payload_of(events[0]) == {"a": 1}
    assert payload_of(events[1]) is None


METRICS_BEFORE = """
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 7.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 4.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
"""


def test_counter_deltas_become_acceptance_figures():
    after = METRICS_BEFORE.replace("} 10.0", "} 14.0").replace("} 30.0", "} 42.0").replace("} 12.0", "} 18.0")
    after = after.replace('position="0"} 7.0', 'position="0"} 10.0').replace('position="1"} 4.0', 'position="1"} 6.0')
    after = after.replace('position="2"} 1.0', 'position="2"} 2.0')
    stats = stats_from_deltas(parse_spec_counters(METRICS_BEFORE), parse_spec_counters(after))
    assert (stats["target_passes"], stats["drafted_tokens"], stats["accepted_tokens"]) == (4, 12, 6)
    assert stats["acceptance_rate"] == pytest.approx(0.5)
    assert stats["mean_accepted_len"] == pytest.approx(1 + 6 / 4)
    assert stats["per_position_acceptance"] == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert stats["k"] == 3


# A real vLLM 0.32 non-streaming chat answer with return_token_ids, and the same answer without the flag.
WITH_IDS = (
    b'{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":'
    b'{"role":"assistant","content":"izun\xef\xbf\xbd","refusal":null,"annotations":null,"audio":null,'
    b'"function_call":null,"reasoning":null},"logprobs":null,"finish_reason":"length","stop_reason":null,'
    b'"token_ids":[502,329,122],"routed_experts":null}],"service_tier":null,"system_fingerprint":"vllm-0.32.0",'
    b'"usage":{"prompt_tokens":3,"total_tokens":6,"completion_tokens":3,"prompt_tokens_details":null,'
    b'"completion_tokens_details":null},"prompt_logprobs":null,"prompt_token_ids":[1,2,3],"prompt_text":null,'
    b'"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
)
WITHOUT_IDS = WITH_IDS.replace(b'"token_ids":[502,329,122]', b'"token_ids":null').replace(
    b'"prompt_token_ids":[1,2,3]', b'"prompt_token_ids":null'
)


def test_shadow_capture_strips_the_ids_it_asked_for_back_to_vllms_bytes():
    from speculation.gateway.shadow import ShadowCapture

    capture = ShadowCapture(call=None, injected=True, wire=wire_for("vllm"))  # type: ignore[arg-type]
    assert capture.on_body(200, WITH_IDS) == WITHOUT_IDS
    assert (capture.prompt_ids, capture.output_ids) == ([1, 2, 3], [502, 329, 122])


def test_shadow_capture_leaves_ids_the_client_asked_for():
    from speculation.gateway.shadow import ShadowCapture

    capture = ShadowCapture(call=None, injected=False, wire=wire_for("vllm"))  # type: ignore[arg-type]
    assert capture.on_body(200, WITH_IDS) == WITH_IDS
    assert capture.output_ids == [502, 329, 122]


def test_shadow_capture_on_sglang_removes_the_ids_it_asked_for():
    # SGLang's completion choice omits token_ids / prompt_token_ids without return_token_ids
    # (sgl-project/sglang openai/protocol.py CompletionResponseChoice); SGLang does not run here.
    from speculation.gateway.shadow import ShadowCapture

    streamed = b'data: {"id":"c","choices":[{"index":0,"text":"a","token_ids":[7],"prompt_token_ids":[1,2]}]}\n\n'
    capture = ShadowCapture(call=None, injected=True, wire=wire_for("sglang"))  # type: ignore[arg-type]
    assert capture.on_chunk(streamed) == b'data: {"id":"c","choices":[{"index":0,"text":"a"}]}\n\n'
    assert (capture.prompt_ids, capture.output_ids) == ([1, 2], [7])


def test_shadow_capture_relays_unreadable_ids_untouched_and_measures_nothing():
    from speculation.gateway.shadow import ShadowCapture

    broken = WITH_IDS.replace(b'"token_ids":[502,329,122]', b'"token_ids":["x"]')
    capture = ShadowCapture(call=None, injected=True, wire=wire_for("vllm"))  # type: ignore[arg-type]
    assert capture.on_body(200, broken) == broken
    assert capture.unreadable


def test_an_answer_nested_too_deep_from_the_server_is_passed_over_not_a_recursion_error():
    deep = b"[" * 100_000 + b"]" * 100_000
    assert payload_of(b"data: " + deep + b"\n\n") is None
    assert payload_of(b'data: {"choices": []}\n\n') == {"choices": []}
