"""bench_gateway's prod_coverage: the mixed request set and the share computed from the prod records."""

from __future__ import annotations

from speculation.bench.coverage import mixed_requests, summarize
from speculation.gateway.exactness import stop_fields_reason, unservable_reason


def test_the_mixed_set_is_greedy_and_carries_the_fields_real_clients_send():
    requests = mixed_requests(["def f(x):", "import os"], model="demo", max_tokens=16)
    assert len(requests) == 2 * 8 + 1
    assert all(body["temperature"] == 0 for _, body in requests)
    fields = {name for _, body in requests for name in body}
    assert {"stop", "stop_token_ids", "min_tokens", "ignore_eos", "echo", "n", "include_stop_str_in_output"} <= fields
    # every request but the logprobs one is one prod serves on the local path
    kinds = [("chat" if path.endswith("chat/completions") else "completion", body) for path, body in requests]
    servable = [
        not unservable_reason(body, kind=kind) and not stop_fields_reason(body, kind=kind, path="local")
        for kind, body in kinds
    ]
    assert servable.count(False) == 1 and "logprobs" in requests[servable.index(False)][1]


def test_coverage_is_the_speculated_share_with_the_reasons_of_the_rest():
    records = [{"action": "speculated", "reason": ""}] * 9 + [{"action": "skipped", "reason": "logprobs requested"}]
    result = summarize(records)
    assert result["prod_coverage"] == 0.9
    assert result["prod_coverage_not_speculated"] == {"skipped: logprobs requested": 1}
