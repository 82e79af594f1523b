"""Fixtures of the worker's tests."""

from __future__ import annotations

import pytest
import redis


@pytest.fixture
def client(redis_server):
    """A client of the test session's real Redis (the broker and the gateway-worker channel)."""
    found = redis.Redis.from_url(redis_server.url)
    yield found
    found.close()


def local_prod_endpoint(client, *, name: str, target_dir, draft_dir):
    """An endpoint in prod on the local path (draft model, K = 3) with its end-to-end baseline already cached, so no
    calibration call is made; returns (endpoint, policy)."""
    import json
    import time

    from fleet.models import Endpoint
    from speculation.models import DraftModel, SpeculationPolicy
    from speculation.worker.baseline import _key
    from tests.support.models import serves

    endpoint = Endpoint.objects.create(name=name, base_url="http://127.0.0.1:9", node_class="cpu")
    serves(endpoint, target_dir)  # the probe's record of the served model: target_dir reproduces it
    draft = DraftModel.objects.create(name=f"{name}-draft", kind="draft_model", path=str(draft_dir))
    policy, _ = SpeculationPolicy.objects.update_or_create(
        endpoint=endpoint,
        defaults={
            "mode": "prod",
            "mechanism": "draft_model",
            "draft": draft,
            "k": 3,
            "path": "local",
            "target_path": str(target_dir),
        },
    )
    client.set(_key(endpoint.pk), json.dumps({"tok_s": 100.0, "at": time.time()}))
    return endpoint, policy
