"""Held-out captures replayed on the endpoint's candidates after a run on captured traffic: greedy ones only, each
under a request id naming its capture, then auto-pairing consulted once per endpoint."""

from __future__ import annotations

import pytest

from fleet.models import Endpoint
from speculation.models import CaptureSetting, SpeculationPolicy
from speculation.selectors.captures import sequences
from speculation.services import captures
from speculation.services.capture_replay import replay_held_out

pytestmark = pytest.mark.django_db


def test_the_greedy_held_out_captures_are_replayed_on_every_candidate(monkeypatch):
    from speculation.worker import candidates

    # given an endpoint with a policy and three captures, two served greedily
    endpoint = Endpoint.objects.create(name="replayed", base_url="http://127.0.0.1:9", kind="vllm")
    SpeculationPolicy.objects.create(endpoint=endpoint, mode="shadow", auto_pairing=True)
    CaptureSetting.objects.create(endpoint=endpoint, enabled=True)
    rows = [dict(endpoint_id=endpoint.pk, workload="code", mode="shadow", prompt_ids=[1, 2], output_ids=[3, i],
                 greedy=i != 5) for i in (4, 5, 6)]  # fmt: skip
    captures.write_captures(rows)
    measured, consulted = [], []
    monkeypatch.setattr(candidates, "measure_candidates", lambda **job: measured.append(job))
    monkeypatch.setattr(candidates, "maybe_auto_apply", lambda endpoint, policy: consulted.append(endpoint.pk))
    held_out = sequences(endpoint_id=endpoint.pk)
    # when they are replayed
    assert replay_held_out(held_out) == 2
    # then each greedy one went through the candidates, unbudgeted, as the output the endpoint served
    assert [(j["request_id"], j["output_ids"], j["workload"], j["budgeted"]) for j in measured] == [
        (f"capture-{s.capture_id}", s.output_ids, "code", False) for s in held_out if s.greedy
    ]
    assert all(j["endpoint"] == endpoint for j in measured) and consulted == [endpoint.pk]
