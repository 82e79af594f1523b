"""Probing a real vLLM (CPU build) serving the locally built demo target: plain, and with vLLM's own n-gram
speculative decoding; and the whole path through a real Celery worker."""

from __future__ import annotations

import time

import pytest
from django.db import transaction

from fleet.adapters import CANARY_TEXT, adapter_for, fingerprint
from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus
from fleet.probing import run_probe
from fleet.tasks import start_probe

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORKER_PROBE_DEADLINE_S = 120


def local_fingerprint(model_dir) -> tuple[str, list[int]]:
    """The fingerprint of the demo target's own tokenizer, computed the way the probe documents it."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir))(CANARY_TEXT, add_special_tokens=True)["input_ids"]
    return fingerprint(ids), list(ids)


@pytest.mark.django_db
def test_probing_the_plain_vllm_finds_a_ready_server_without_native_speculation(vllm_server, demo_pair):
    # given the demo endpoint registered against the real vLLM
    endpoint = Endpoint.objects.create(name="demo", base_url=vllm_server.base_url, kind="vllm")
    probe = Probe.objects.create(endpoint=endpoint)
    # when
    run_probe(probe.pk)
    # then
    endpoint.refresh_from_db()
    probe.refresh_from_db()
    caps = endpoint.capabilities
    assert endpoint.status == EndpointStatus.READY, (endpoint.status_reason, probe.errors)
    assert probe.errors == []
    assert endpoint.served_model == vllm_server.model
    assert caps["models"] == [vllm_server.model]
    assert caps["max_context"] == 1024
    assert caps["server_version"] == "0.32.0"
    assert caps["tokenize"] and caps["detokenize"] and caps["detokenize_roundtrip"]
    assert caps["token_id_prompts"] is True
    assert caps["prompt_scoring"] is True
    assert caps["prompt_scoring_method"] == "prompt_logprobs"
    assert caps["max_logprobs"] == 20  # vLLM's default --max-logprobs
    expected_fingerprint, expected_ids = local_fingerprint(demo_pair.target_dir)
    assert caps["canary_token_ids"] == expected_ids
    assert caps["tokenizer_fingerprint"] == expected_fingerprint
    assert caps["native_speculation"] is False
    assert caps["ttft_ms"] > 0 and caps["tpot_ms"] > 0
    assert caps["latency_output_tokens"] == 16


def test_probing_the_ngram_vllm_finds_native_speculation_with_its_method_and_k(vllm_ngram_server):
    report = adapter_for("vllm", base_url=vllm_ngram_server.base_url).probe()
    caps = report.capabilities
    assert report.ok, report.errors
    assert caps["native_speculation"] is True
    assert caps["native_speculation_k"] == 3
    assert caps["native_speculation_method"] == "ngram"
    assert caps["prompt_scoring"] is True


def test_the_openai_compatible_adapter_scores_prompts_on_vllm_with_echo(vllm_server):
    report = adapter_for("openai", base_url=vllm_server.base_url).probe()
    caps = report.capabilities
    assert report.errors == []
    assert caps["prompt_scoring_method"] == "echo_logprobs"
    assert caps["max_logprobs"] == 20
    assert caps["token_id_prompts"] is True
    assert caps["native_speculation"] is None


@pytest.mark.worker
@pytest.mark.django_db(transaction=True)
def test_a_real_worker_probes_a_registered_endpoint_until_it_is_ready(celery_worker, vllm_server):
    # given an endpoint registered and its probe queued on commit
    with transaction.atomic():
        endpoint = Endpoint.objects.create(name="demo-worker", base_url=vllm_server.base_url, kind="vllm")
        probe = start_probe(endpoint)
    # when the worker picks it up
    deadline = time.monotonic() + WORKER_PROBE_DEADLINE_S
    while time.monotonic() < deadline:
        probe.refresh_from_db()
        if probe.status == ProbeStatus.DONE:
            break
        time.sleep(0.5)
    # then
    assert probe.status == ProbeStatus.DONE, f"worker did not finish the probe:\n{celery_worker.log_tail()}"
    endpoint.refresh_from_db()
    assert endpoint.status == EndpointStatus.READY, endpoint.status_reason
    assert endpoint.capabilities["max_context"] == 1024
    assert endpoint.served_model == vllm_server.model
