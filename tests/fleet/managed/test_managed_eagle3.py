"""An EAGLE-3 head deployed on a managed endpoint: the real vLLM (CPU build) serves the demo target, a head in
vLLM's EAGLE-3 layout (what `--multi-layer` training saves; untrained here, as training starts it) registers
through the REST API, and prod on path native switches the server blue/green to one started with the head's
`method: "eagle3"` flags. Either the switch canary passes it, and then the new server drafts with the head
(`vllm:spec_decode_num_drafts_total` grows) and answers greedy requests as off did; or the canary refuses it, and
the plain server keeps serving and the switch says why (as for draft models on vLLM 0.32's CPU build)."""

from __future__ import annotations

import shutil

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet.managed.models import InstanceRole, InstanceState, ServerInstance, Switch, SwitchStatus
from fleet.managed.services import create_managed_endpoint
from fleet.models import Endpoint
from speculation.models import DraftModel
from speculation.services.policies import update_policy
from tests.speculation.selectors.test_native_flags_vllm import spec_drafts_total
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.worker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PROMPTS = ["def parse_args(argv):\n    ", "class Stack:\n    def __init__(self):\n"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _greedy(client, model: str, prompt: str) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0).choices[0].text


def _eagle3_head(target_dir, directory):
    import torch

    from speculation.engine.eagle import EagleConfig, init_weights, make_head
    from speculation.engine.loader import load_causal_lm

    head = make_head(EagleConfig.for_target(target_dir, multi_layer=True))
    init_weights(head, torch.Generator().manual_seed(0))
    head.norm.weight.data.copy_(load_causal_lm(target_dir).norm.weight)
    head.save(directory)
    for name in TOKENIZER_FILES:  # registration reads the head's tokenizer (the target's)
        if (target_dir / name).exists():
            shutil.copy(target_dir / name, directory / name)
    return directory


def test_prod_native_with_an_eagle3_head_switches_the_managed_vllm_to_draft_with_it(
    managed_worker, demo_pair, gateway_client, user, tmp_path
):
    # given: a managed endpoint serving the demo target plainly, and its greedy answers
    endpoint = create_managed_endpoint(
        name="managed-eagle3",
        model_dir=str(demo_pair.target_dir),
        node_class=managed_worker.extra["node_class"],
        server_args={"dtype": "float32", "max_model_len": 1024, "enforce_eager": True},
        created_by=user,
    )
    wait_for("the plain server", lambda: ServerInstance.objects.filter(
        managed__endpoint=endpoint, role=InstanceRole.ACTIVE, state=InstanceState.READY).exists())  # fmt: skip
    endpoint.refresh_from_db()  # routed, probed: its tokenizer fingerprint known
    off = [_greedy(gateway_client, endpoint.name, p) for p in PROMPTS]

    # when: an EAGLE-3 head registers through REST and prod runs it on path native
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    head_dir = _eagle3_head(demo_pair.target_dir, tmp_path / "head")
    response = api.post("/api/v1/drafts/", {"name": "demo-eagle3", "kind": "eagle_head", "path": str(head_dir)},
                        format="json")  # fmt: skip
    assert response.status_code == 201, response.content
    head = DraftModel.objects.get(name="demo-eagle3")
    update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="eagle_head", draft=head, k=3, path="native")
    switch = wait_for("the switch to end", lambda: Switch.objects.filter(
        managed__endpoint=endpoint, status__in=[SwitchStatus.DONE, SwitchStatus.FAILED]).first())  # fmt: skip

    if switch.status == SwitchStatus.FAILED:  # then: the canary refused it saying why (on vLLM 0.32 CPU: wrong
        # greedy answers in mixed greedy/sampled batches with speculation on); the plain server keeps serving
        assert "Switch refused" in switch.reason and "differ" in switch.reason, switch.reason
        assert [_greedy(gateway_client, endpoint.name, p) for p in PROMPTS] == off
        return
    # then: the new server drafts with the head, and its greedy answers are off's
    assert switch.speculation["draft_kind"] == "eagle_head"
    endpoint.refresh_from_db()
    assert endpoint.policy.mode == "prod" and endpoint.policy.path == "native"
    before = spec_drafts_total(endpoint.base_url)
    assert [_greedy(gateway_client, endpoint.name, p) for p in PROMPTS] == off
    assert spec_drafts_total(endpoint.base_url) > before, "vLLM reported no EAGLE-3 drafts"
    Endpoint.objects.filter(pk=endpoint.pk).delete()  # its server stops
