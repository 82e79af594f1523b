"""One table of the OpenAI request's fields and one greediness rule, read by the gateway, the worker and the fuzzer."""

from __future__ import annotations

import pytest

from ace.fuzz import gateway as fuzz_gateway
from speculation import openai_fields
from speculation.gateway import validation
from speculation.gateway.guard import rules
from speculation.gateway.sampling import parse


@pytest.mark.parametrize(
    ("temperature", "greedy"),
    [(0, True), (0.0, True), (1e-6, True), (1e-5, False), (0.7, False), (1, False), (None, False)]
    + [(False, False), ("0", False)],
)
def test_it_reads_greediness_as_the_server_does(temperature, greedy):
    # vLLM decodes greedily below 1e-5; no temperature is OpenAI's default 1; a non-number is refused upstream
    assert openai_fields.is_greedy(temperature) is greedy
    # the gateway's sampling and the guard's traffic class read the same rule
    assert rules.traffic_of({"temperature": temperature}) == (rules.GREEDY if greedy else rules.SAMPLED)
    if isinstance(temperature, int | float) and not isinstance(temperature, bool):
        assert parse({"temperature": temperature}).greedy is greedy


def test_the_gateway_checks_every_field_of_the_table_and_no_other():
    for kind, checks in (("completion", validation.COMPLETION), ("chat", validation.CHAT)):
        assert set(checks) == {*openai_fields.COMMON, *openai_fields.ROUTE_ONLY[kind]}, kind


def test_prod_serves_only_fields_a_route_takes():
    every = {"model", *openai_fields.COMMON, *openai_fields.COMPLETION_ONLY, *openai_fields.CHAT_ONLY}
    assert openai_fields.SERVED_BY_PROD <= every
    assert set(openai_fields.STOP) <= openai_fields.SERVED_BY_PROD


def test_the_fuzzer_varies_every_field_of_the_table():
    assert set(fuzz_gateway.COMMON_FIELDS) == {"model", *openai_fields.COMMON, "an_unknown_field"}
    assert {kind: set(names) for kind, names in fuzz_gateway.FIELDS.items()} == {
        kind: set(names) for kind, names in openai_fields.ROUTE_ONLY.items()
    }
