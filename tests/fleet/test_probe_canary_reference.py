"""The probe records the served model's own answers on the canary: the reference a local target must reproduce."""

from __future__ import annotations

from fleet.adapters import CANARY_TEXT, REFERENCE_TOP_N, adapter_for
from tests.support.server_shapes import fake_token_ids, openai_routes, sglang_routes


def test_it_records_the_canary_and_the_servers_top_log_probabilities_at_every_position(http_stub):
    stub = http_stub(sglang_routes())
    reference = adapter_for("sglang", base_url=stub.base_url).probe().capabilities["canary_reference"]
    ids = fake_token_ids(CANARY_TEXT)
    assert reference["prompt_len"] == len(ids) and reference["token_ids"][: len(ids)] == ids
    top = reference["top_logprobs"]
    assert len(top) == len(reference["token_ids"]) and top[0] is None
    assert all(len(position) == REFERENCE_TOP_N for position in top[1:])
    # the greedy continuation was asked for by token ids, at temperature 0
    asked = [r.json() for r in stub.requests if r.path == "/v1/completions" and r.json().get("prompt") == ids]
    assert asked and asked[0]["temperature"] == 0 and asked[0]["return_token_ids"] is True


def test_a_server_that_cannot_continue_token_ids_records_no_reference(http_stub):
    stub = http_stub(openai_routes())
    report = adapter_for("openai", base_url=stub.base_url).probe()
    assert report.errors == [] and report.capabilities["canary_reference"] is None


def test_the_endpoint_page_summarises_the_reference_instead_of_listing_it():
    from fleet import selectors

    reference = {"token_ids": list(range(30)), "prompt_len": 14, "top_logprobs": [None] + [[[1, -0.1]] * 5] * 29}
    greedy_only = {**reference, "top_logprobs": None, "greedy_only": "no scoring"}
    [row] = selectors.capability_rows({"canary_reference": reference})
    assert row.value == "greedy continuation of 16 tokens; top 5 log-probabilities at 29 positions"
    [row] = selectors.capability_rows({"canary_reference": greedy_only})
    assert row.value == "greedy continuation of 16 tokens alone (no scoring)"
