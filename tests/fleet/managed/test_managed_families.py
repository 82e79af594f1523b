"""Model families through the product: the real vLLM (CPU build) serves a tiny Llama-3-style checkpoint (rope type
llama3) and a tiny Qwen3-style one (q/k norms, explicit head_dim, a vocabulary padded past its tokenizer's) as managed
endpoints, started by a real Celery worker's supervisor; one vLLM start per family.

For each: a same-family draft (the target's first layer; Qwen's padded to another vocabulary size than its target's,
as Qwen's own checkpoints differ) registers through the REST API; shadow on the local path records its acceptance,
and the worker's background work on the request (the cost calibration and auto-pairing's candidate replays) runs on
the family's checkpoints; prod on the local path gives greedy text token-identical to off.
"""

from __future__ import annotations

import time

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet.managed.models import InstanceRole, InstanceState, ServerInstance
from fleet.managed.services import create_managed_endpoint
from fleet.models import Endpoint
from speculation.models import CandidateMeasurement, DraftModel, StageRecord
from speculation.services.policies import update_policy
from tests.support.families import DEMO_VOCAB, family_checkpoint, first_layer_draft
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.worker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n"]
MAX_TOKENS = 16
K = 3
# family -> (target vocabulary, draft vocabulary): Qwen pads past its tokenizer, to sizes that differ
FAMILIES = {"llama3": (DEMO_VOCAB, DEMO_VOCAB), "qwen3": (DEMO_VOCAB + 128, DEMO_VOCAB + 64)}
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "head_dim": 32}  # vLLM's CPU attention: head_dim >= 32


def _gateway_sees_it() -> None:
    """Until a policy change has reached the gateway process (speculation.gateway.freshness)."""
    from speculation.gateway import freshness

    time.sleep(freshness.RECHECK_S + 0.5)


def _greedy(client, model: str, prompt: str) -> tuple[list[int], str]:
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    return reply.choices[0].model_extra["token_ids"], reply.choices[0].text


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_same_family_draft_registers_shadow_measures_it_and_prod_local_gives_off_text(
    family, managed_worker, demo_pair, gateway_client, user, tmp_path
):
    # given a managed endpoint serving a tiny checkpoint of the family (later layers quiet: the draft agrees often)
    target_vocab, draft_vocab = FAMILIES[family]
    target_dir = family_checkpoint(tmp_path / "target", family, tokenizer_dir=demo_pair.target_dir, layers=2,
                                   vocab=target_vocab, quiet_layers=0.05, **SHAPE)  # fmt: skip
    draft_dir = first_layer_draft(target_dir, tmp_path / "draft", vocab=draft_vocab)
    endpoint = create_managed_endpoint(
        name=f"managed-{family}",
        model_dir=str(target_dir),
        node_class=managed_worker.extra["node_class"],
        server_args={"dtype": "float32", "max_model_len": 512, "enforce_eager": True},
        created_by=user,
    )
    wait_for(
        "the server to serve",
        lambda: ServerInstance.objects.filter(
            managed__endpoint=endpoint, role=InstanceRole.ACTIVE, state=InstanceState.READY
        ).exists(),
    )
    endpoint.refresh_from_db()
    assert endpoint.status == "ready", endpoint.status_reason
    off = {p: _greedy(gateway_client, endpoint.name, p) for p in PROMPTS}
    assert all(ids for ids, _ in off.values())

    # when a same-family draft registers through the REST API
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    response = api.post("/api/v1/drafts/", {"name": f"{family}-draft", "kind": "draft_model", "path": str(draft_dir)},
                        format="json")  # fmt: skip
    # then it is accepted, with the endpoint's tokenizer
    assert response.status_code == 201, response.content
    draft = DraftModel.objects.get(name=f"{family}-draft")
    assert draft.tokenizer_fingerprint == endpoint.capabilities["tokenizer_fingerprint"]
    assert draft.vocab_size == draft_vocab

    # when shadow measures it on the local path
    update_policy(endpoint=endpoint, mode="shadow", mechanism="draft_model", draft=draft, k=K, path="local",
                  target_path=str(target_dir), shadow_sample_rate=1.0)  # fmt: skip
    _gateway_sees_it()
    for prompt in PROMPTS:
        assert _greedy(gateway_client, endpoint.name, prompt) == off[prompt]
    # then: its records carry the draft's acceptance, and the background work (cost calibration, candidates) ends
    shadow = wait_for(
        "shadow records with acceptance and a projection",
        lambda: list(StageRecord.objects.filter(endpoint=endpoint, mode="shadow", multiplier__gt=0)),
    )
    assert all(r.action == "would_speculate" and r.acceptance_rate is not None for r in shadow), shadow[0].reason
    assert sum(r.accepted_tokens for r in shadow) > 0
    wait_for(
        "the candidates' replays",
        lambda: CandidateMeasurement.objects.filter(endpoint=endpoint, request_id=shadow[-1].request_id).exists(),
    )

    # when prod runs the draft on the local path
    update_policy(endpoint=endpoint, mode="prod")
    _gateway_sees_it()
    # then: greedy text and tokens identical to off, speculated locally
    for prompt in PROMPTS:
        assert _greedy(gateway_client, endpoint.name, prompt) == off[prompt]

    def prod_records() -> list[StageRecord]:
        found = list(StageRecord.objects.filter(endpoint=endpoint, mode="prod").order_by("pk"))
        return found if len(found) >= len(PROMPTS) else []

    prod = wait_for("a prod record per request", prod_records, 120)
    assert [(r.action, r.path) for r in prod] == [("speculated", "local")] * len(prod), prod[0].reason
    assert sum(r.accepted_tokens for r in prod) > 0

    Endpoint.objects.filter(pk=endpoint.pk).delete()  # its server stops (one vLLM at a time)
