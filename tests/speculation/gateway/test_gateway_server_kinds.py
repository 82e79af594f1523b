"""The gateway speaks each endpoint's server kind through the kind's adapter (fleet.adapters.wire): shadow asks
for token ids only where the kind returns them, and relays the answer as that kind sends it without the flag.

SGLang and a generic OpenAI-compatible server do not run here: the stub answers have the shapes of SGLang's
CompletionResponseChoice (sgl-project/sglang openai/protocol.py: token_ids / prompt_token_ids omitted unless
return_token_ids) and of the OpenAI completions API. vLLM's own case runs against the real server in
test_gateway_modes.py.
"""

from __future__ import annotations

import asyncio

import pytest
from asgiref.sync import async_to_sync
from django.test import AsyncClient

MODEL = "stub-model"
PROMPT_IDS = [11, 12, 13]
OUTPUT_IDS = [21, 22]


def completions(request) -> dict:
    body = request.json()
    choice = {"index": 0, "text": "ab", "logprobs": None, "finish_reason": "length"}
    if body.get("return_token_ids"):
        choice.update(token_ids=OUTPUT_IDS, prompt_token_ids=PROMPT_IDS)
    return {"id": "c", "object": "text_completion", "model": MODEL, "choices": [choice], "usage": None}


@pytest.mark.django_db
@pytest.mark.parametrize(("kind", "measured"), [("sglang", True), ("openai", False)])
def test_shadow_asks_for_token_ids_only_where_the_server_kind_returns_them(
    kind, measured, http_stub, django_user_model, redis_server, monkeypatch
):
    from rest_framework.authtoken.models import Token

    from fleet.models import Endpoint
    from speculation.jobs import queue
    from speculation.models import Mode, SpeculationPolicy

    # given a shadow endpoint of this kind that samples every request
    stub = http_stub({("POST", "/v1/completions"): completions})
    endpoint = Endpoint.objects.create(
        name=f"shadow-{kind}", base_url=stub.base_url, kind=kind, served_model=MODEL, status="ready"
    )
    SpeculationPolicy.objects.create(endpoint=endpoint, mode=Mode.SHADOW, shadow_sample_rate=1.0)
    admin = django_user_model.objects.create_superuser(username=f"kinds-{kind}", password="pw-for-tests-only")
    token = Token.objects.create(user=admin).key
    queued: list[dict] = []
    monkeypatch.setattr(queue, "enqueue_shadow", lambda job, **kwargs: queued.append(job.to_dict()))

    async def ask() -> dict:
        response = await AsyncClient().post(
            "/v1/completions",
            data={"model": endpoint.name, "prompt": "hi", "max_tokens": 2, "temperature": 0},
            content_type="application/json",
            headers={"Authorization": f"Bearer {token}"},
        )
        assert response.status_code == 200
        for _ in range(200):  # the measurement is queued off the request path, after the last byte
            if queued or not measured:
                break
            await asyncio.sleep(0.05)
        return response.json()

    # when
    answer = async_to_sync(ask)()
    # then the client gets the answer as an unsampled request gets it
    upstream = [r.json() for r in stub.requests if r.path == "/v1/completions"]
    assert bool(upstream[0].get("return_token_ids")) is measured
    assert "token_ids" not in answer["choices"][0] and "prompt_token_ids" not in answer["choices"][0]
    # and only a kind that returns token ids is measured, with the ids the server produced
    if measured:
        assert (queued[0]["prompt_ids"], queued[0]["output_ids"]) == (PROMPT_IDS, OUTPUT_IDS)
    else:
        assert queued == []
