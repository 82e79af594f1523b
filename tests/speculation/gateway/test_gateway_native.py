"""Native path: vLLM runs its own n-gram speculation; ACE passes requests through and records the acceptance
vLLM reports. The test reads vLLM's own /metrics counters around each request (one at a time, so the deltas
belong to that request alone) and requires the stage record to hold exactly those numbers."""

from __future__ import annotations

import time

import httpx
import pytest

from fleet.adapters.vllm_metrics import parse_spec_counters
from speculation.models import StageRecord
from speculation.services.policies import update_policy
from tests.support.stack import register_probed_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Repetitive prompts: n-gram prompt lookup finds something to propose.
PROMPTS = ["for i in range(10):\n    print(i)\nfor i in range(10):\n", "a = 1\nb = 2\na = 1\nb = 2\na = 1\n"]


def _counters(base_url: str) -> dict[str, float]:
    return parse_spec_counters(httpx.get(base_url + "/metrics", timeout=30).text)


def test_native_records_match_vllms_own_counters(vllm_ngram_server, gateway_client):
    endpoint = register_probed_endpoint(name="demo-ngram", base_url=vllm_ngram_server.base_url)
    assert endpoint.capabilities["native_speculation"] is True
    policy = update_policy(endpoint=endpoint, mode="prod", mechanism="ngram", k=3)
    assert policy.path == "auto"
    for n, prompt in enumerate(PROMPTS, start=1):
        before = _counters(vllm_ngram_server.base_url)
        reply = gateway_client.completions.create(model=endpoint.name, prompt=prompt, max_tokens=24, temperature=0)
        deadline = time.monotonic() + 30
        while StageRecord.objects.filter(endpoint=endpoint).count() < n and time.monotonic() < deadline:
            time.sleep(0.2)
        after = _counters(vllm_ngram_server.base_url)
        record = StageRecord.objects.filter(endpoint=endpoint).order_by("-id").first()
        assert record.action == "speculated" and record.path == "native", record.reason
        drafted = after["vllm:spec_decode_num_draft_tokens"] - before.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get("vllm:spec_decode_num_accepted_tokens", 0)
        drafts = after["vllm:spec_decode_num_drafts"] - before.get("vllm:spec_decode_num_drafts", 0)
        assert (record.drafted_tokens, record.accepted_tokens, record.target_passes) == (drafted, accepted, drafts)
        assert record.output_tokens == reply.usage.completion_tokens
        if drafted:
            assert record.acceptance_rate == pytest.approx(accepted / drafted, abs=1e-12)
