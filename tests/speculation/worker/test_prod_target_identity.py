"""The worker checks the local target again when it loads it: a folder that does not reproduce the endpoint's
served model never serves a token (the gateway then answers plain, with the reason)."""

from __future__ import annotations

import json
import time

import pytest

from speculation.jobs.admission import inflight_key
from tests.speculation.worker.conftest import local_prod_endpoint
from tests.support.models import serves


def _job(client, endpoint) -> dict:
    request_id = f"identity-{time.monotonic_ns()}"
    client.zadd(inflight_key("cpu"), {request_id: time.time() + 60})
    return {
        "request_id": request_id,
        "endpoint_id": endpoint.pk,
        "prompt_ids": [1, 5, 6, 7],
        "max_tokens": 8,
        "k": 3,
        "path": "local",
        "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0},
        "stop": {"ignore_eos": True},
        "node_class": "cpu",
    }


def _messages(client, request_id: str) -> list[dict]:
    from speculation.jobs.channel import key

    return [json.loads(m) for m in client.lrange(key(request_id), 0, -1)]


@pytest.mark.django_db
def test_a_target_that_is_not_the_endpoints_model_is_refused_at_load_and_serves_nothing(
    redis_server, client, tiny_model_dir, other_model_dir
):
    from speculation.worker.generation import run_prod_generation

    # given: prod on the local path whose target_path holds another checkpoint than the server runs (saved before
    # the check existed, or its files replaced since)
    endpoint, _ = local_prod_endpoint(client, name="imposter", target_dir=other_model_dir, draft_dir=tiny_model_dir)
    serves(endpoint, tiny_model_dir)
    job = _job(client, endpoint)
    # when
    run_prod_generation(job)
    # then: no token, one error whose reason says what differed (the gateway falls back with it)
    messages = _messages(client, job["request_id"])
    assert [m["type"] for m in messages] == ["error"], messages
    assert messages[0]["reason"].startswith("target_path does not reproduce the endpoint's model: ")
    assert client.zscore(inflight_key("cpu"), job["request_id"]) is None


@pytest.mark.django_db
def test_the_endpoints_own_model_serves(redis_server, client, tiny_model_dir):
    from speculation.worker.generation import run_prod_generation

    endpoint, _ = local_prod_endpoint(client, name="own", target_dir=tiny_model_dir, draft_dir=tiny_model_dir)
    job = _job(client, endpoint)
    run_prod_generation(job)
    messages = _messages(client, job["request_id"])
    assert messages[-1]["type"] == "done", messages
    assert sum(len(m["ids"]) for m in messages if m["type"] == "tokens") == 8
