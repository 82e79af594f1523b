"""The stage's Prometheus metrics: a gateway request and a stage record move them, reasons become a bounded set
of labels, and in multiprocess mode /metrics sums what every process counted."""

from __future__ import annotations

import subprocess
import sys

import pytest
from asgiref.sync import async_to_sync
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from ace import processes
from speculation.selectors import metrics
from tests.support.prometheus import samples

MODEL = "metered-model"


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)


def delta(before: str, after: str, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture
def admin_token(django_user_model) -> str:
    from rest_framework.authtoken.models import Token

    admin = django_user_model.objects.create_superuser(username="metrics-admin", password="pw-for-tests-only")
    return Token.objects.create(user=admin).key


@pytest.fixture
def off_endpoint(http_stub):
    from fleet.models import Endpoint

    def completion(request):
        return {
            "id": "cmpl-1",
            "object": "text_completion",
            "model": MODEL,
            "choices": [{"index": 0, "text": " world", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3},
        }

    stub = http_stub({("POST", "/v1/completions"): completion})
    return Endpoint.objects.create(name="metered", base_url=stub.base_url, served_model=MODEL, status="ready")


@pytest.mark.django_db
def test_a_gateway_request_moves_the_requests_counter(client, off_endpoint, admin_token, redis_server):
    before = client.get("/metrics").content.decode()
    response = client.post(
        "/v1/completions",
        data={"model": "metered", "prompt": "hello", "max_tokens": 1, "temperature": 0},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {admin_token}",
    )
    assert response.status_code == 200, response.content
    after = client.get("/metrics").content.decode()
    labels = {"endpoint": "metered", "mode": "off", "action": "passthrough"}
    assert delta(before, after, "ace_requests_total", **labels) == 1


@pytest.mark.django_db
def test_a_prod_record_moves_requests_histograms_and_token_counters(client, off_endpoint, redis_server):
    from speculation.services.records import arecord_stage

    series = {"endpoint": "metered", "mode": "prod"}
    before = client.get("/metrics").content.decode()
    async_to_sync(arecord_stage)(
        endpoint_id=off_endpoint.pk,
        request_id="r-speculated",
        mode="prod",
        action="speculated",
        acceptance_rate=0.75,
        mean_accepted_len=3.2,
        multiplier=1.6,
        drafted_tokens=40,
        accepted_tokens=30,
        output_tokens=48,
    )
    after = client.get("/metrics").content.decode()
    assert delta(before, after, "ace_requests_total", action="speculated", **series) == 1
    for name, bucket, below in (
        ("ace_acceptance_rate", "0.8", "0.7"),
        ("ace_mean_accepted_length", "3.5", "3.0"),
        ("ace_multiplier", "1.75", "1.5"),
    ):
        moved = delta(before, after, f"{name}_bucket", le=bucket, **series)
        still = delta(before, after, f"{name}_bucket", le=below, **series)
        assert (moved, still) == (1, 0), name
    assert delta(before, after, "ace_drafted_tokens_total", **series) == 40
    assert delta(before, after, "ace_accepted_tokens_total", **series) == 30


@pytest.mark.django_db
def test_fallbacks_count_by_reason_class_never_by_text(client, off_endpoint, redis_server):
    from speculation.services.records import record_stage

    reason = "no worker on gpu.cpu took the request within 5 s (request 0123456789abcdef)"
    before = client.get("/metrics").content.decode()
    record_stage(endpoint_id=off_endpoint.pk, request_id="r-fb", mode="prod", action="fell_back", reason=reason)
    after = client.get("/metrics").content.decode()
    labels = {"endpoint": "metered", "reason": "no_worker"}
    assert delta(before, after, "ace_fallbacks_total", **labels) == 1
    assert "0123456789abcdef" not in after


@pytest.mark.parametrize(
    ("action", "reason", "label"),
    [
        ("fell_back", "redis unavailable: ConnectionError: Error 111", "redis_unavailable"),
        ("fell_back", "redis failed while streaming: TimeoutError after 3 tokens", "redis_failed"),
        ("fell_back", "worker sent nothing for 30 s after 12 tokens", "worker_timeout"),
        ("fell_back", "client went away after 1 tokens", "client_gone"),
        ("fell_back", "tokenize failed: /tokenize: ConnectError", "tokenize_failed"),
        ("fell_back", "speculative path failed: RuntimeError: boom (after 0 tokens)", "worker_error"),
        ("fell_back", "could not enqueue: OperationalError: x", "enqueue_failed"),
        ("fell_back", "HTTP 500 from the server", "upstream_error"),
        ("fell_back", "something nobody foresaw", "other"),
        ("skipped", "temperature 0.7 > 0: prod is exact for greedy requests only", "sampled"),
        ("skipped", "n > 1 is not served by prod", "n_gt_1"),
        ("skipped", "logprobs requested", "logprobs"),
        ("skipped", "a batch of prompts is not served by prod", "batched_prompts"),
        ("skipped", "too long: 900 prompt + 200 new tokens > context 1024", "too_long"),
        ("skipped", "top_p 2 outside (0, 1]", "invalid_request"),
        ("skipped", "unsupported parameter stop", "unsupported_parameter"),
        ("skipped", "worker at capacity: 1 of 1 prod slots on gpu.cpu in use", "worker_at_capacity"),
    ],
)
def test_reasons_map_to_their_bounded_label(action, reason, label):
    assert metrics.reason_class(action, reason) == label
    assert label in metrics.REASON_LABELS[action]


FEED = """
from speculation.selectors import metrics
metrics.count_passthrough(endpoint="e", mode="off")
metrics.observe_record(endpoint="e", mode="shadow", action="would_speculate", fields={"acceptance_rate": 0.5})
"""


def test_multiprocess_mode_sums_what_every_process_counted(tmp_path):
    # given: two processes (as two uvicorn workers, or a web and a worker) counting into one directory
    for _ in range(2):
        subprocess.run(
            [sys.executable, "-c", FEED],
            cwd=processes.REPO_ROOT,
            env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
            check=True,
            timeout=60,
        )
    # when: the exposition reads the directory
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(tmp_path))
    text = generate_latest(registry).decode()
    # then
    assert value(text, "ace_requests_total", endpoint="e", mode="off", action="passthrough") == 2
    assert value(text, "ace_requests_total", endpoint="e", mode="shadow", action="would_speculate") == 2
    assert value(text, "ace_acceptance_rate_count", endpoint="e", mode="shadow") == 2


@pytest.mark.django_db
def test_the_metrics_view_reads_the_multiprocess_directory_when_set(client, tmp_path, monkeypatch, redis_server):
    subprocess.run(
        [sys.executable, "-c", FEED],
        cwd=processes.REPO_ROOT,
        env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
        check=True,
        timeout=60,
    )
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    text = client.get("/metrics").content.decode()
    assert value(text, "ace_requests_total", endpoint="e", mode="off", action="passthrough") == 1
    assert value(text, "ace_redis_up") == 1


@pytest.mark.django_db
def test_a_renamed_endpoint_counts_under_its_new_name_at_once(client, off_endpoint, redis_server):
    from speculation.services.records import record_stage

    def counted(name: str, before: str) -> float:
        after = client.get("/metrics").content.decode()
        return delta(before, after, "ace_requests_total", endpoint=name, mode="shadow", action="would_speculate")

    # given: a record counted under the endpoint's name (the name is now cached in this process)
    before = client.get("/metrics").content.decode()
    record_stage(endpoint_id=off_endpoint.pk, request_id="r-1", mode="shadow", action="would_speculate")
    assert counted("metered", before) == 1
    # when it is renamed (or, on SQLite, deleted and its id given to a new endpoint)
    off_endpoint.name = "renamed"
    off_endpoint.save()
    before = client.get("/metrics").content.decode()
    record_stage(endpoint_id=off_endpoint.pk, request_id="r-2", mode="shadow", action="would_speculate")
    # then the next record counts under the new name, not the cached one
    assert counted("renamed", before) == 1 and counted("metered", before) == 0
