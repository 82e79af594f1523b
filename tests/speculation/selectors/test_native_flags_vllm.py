"""The flags ACE produces start a real vLLM (CPU build) that speculates with the registered draft."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from ace import processes
from fleet.models import Endpoint
from speculation.models import DraftModel
from speculation.selectors.native_flags import flags_for_endpoint
from speculation.services.drafts import register_draft

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.django_db]

SERVED_NAME = "ace-demo-target"
_COUNTER = re.compile(r"^vllm:spec_decode_num_drafts_total(?:\{[^}]*\})?\s+([0-9.eE+]+)$", re.MULTILINE)


def spec_drafts_total(base_url: str) -> float:
    """Sum of vllm:spec_decode_num_drafts_total over its label sets (absent when vLLM does not speculate)."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(value) for value in _COUNTER.findall(text))


def start_vllm_with(flags, *, target_dir: Path, log_dir: Path) -> processes.ManagedProcess:
    # The fleet launcher takes the --speculative-config value as a dict and writes it back as JSON.
    assert flags.args[0] == "--speculative-config"
    config = json.loads(flags.args[1])
    return processes.start_vllm(
        model_dir=target_dir, served_model_name=SERVED_NAME, log_dir=log_dir, speculative_config=config
    )


def test_demo_draft_flags_start_a_vllm_that_speculates(demo_pair, artifacts_dir):
    # given: the demo draft registered, and an endpoint running vLLM
    draft = register_draft(name="demo-draft", kind="draft_model", path=str(demo_pair.draft_dir))
    endpoint = Endpoint.objects.create(name="local-vllm", base_url="http://127.0.0.1:1", kind="vllm")
    flags = flags_for_endpoint(endpoint=endpoint, draft=draft, k=3)
    assert flags.speculative_config["method"] == "draft_model"

    # when: vLLM starts with exactly those flags and serves one greedy request
    proc = start_vllm_with(flags, target_dir=demo_pair.target_dir, log_dir=artifacts_dir)
    try:
        response = httpx.post(
            f"{proc.url}/v1/completions",
            json={"model": SERVED_NAME, "prompt": "def parse_args(argv):\n    ", "max_tokens": 48, "temperature": 0},
            timeout=120,
        )
        response.raise_for_status()
        drafts = spec_drafts_total(proc.url)
    finally:
        proc.stop()

    # then: the server drafted with the registered draft
    assert response.json()["choices"][0]["text"]
    assert drafts > 0, "vLLM reported no speculative drafts"


def test_eagle_head_flags_start_a_vllm_that_drafts_with_the_head(demo_pair, artifacts_dir, tmp_path):
    # given: an EAGLE head saved by ACE for the demo target (untrained: vLLM only has to load and run it)
    import torch

    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights

    head = EagleHead(EagleConfig.for_target(demo_pair.target_dir))
    init_weights(head, torch.Generator().manual_seed(0))
    head.save(tmp_path / "head")
    endpoint = Endpoint.objects.create(name="local-vllm-eagle", base_url="http://127.0.0.1:1", kind="vllm")
    draft = DraftModel.objects.create(name="demo-head", kind="eagle_head", path=str(tmp_path / "head"))
    flags = flags_for_endpoint(endpoint=endpoint, draft=draft, k=2)
    assert flags.speculative_config["method"] == "eagle"

    # when: vLLM starts with exactly those flags and serves one greedy request
    proc = start_vllm_with(flags, target_dir=demo_pair.target_dir, log_dir=artifacts_dir)
    try:
        response = httpx.post(
            f"{proc.url}/v1/completions",
            json={"model": SERVED_NAME, "prompt": "import os\n", "max_tokens": 24, "temperature": 0},
            timeout=120,
        )
        response.raise_for_status()
        drafts = spec_drafts_total(proc.url)
    finally:
        proc.stop()

    # then: vLLM ran ACE's head as its EAGLE drafter
    assert drafts > 0, "vLLM reported no EAGLE drafts"


def test_an_eagle3_head_from_the_rest_flags_drafts_in_vllm_and_answers_as_the_plain_server(
    demo_pair, artifacts_dir, tmp_path, api, vllm_server
):
    # given: an EAGLE-3 head saved by ACE for the demo target (what `--multi-layer` training writes; here untrained,
    # as the training pipeline starts it), the policy of a vLLM endpoint drafting with it
    import torch

    from speculation.engine.eagle import EagleConfig, init_weights, make_head
    from speculation.engine.loader import load_causal_lm
    from speculation.models import SpeculationPolicy

    head = make_head(EagleConfig.for_target(demo_pair.target_dir, multi_layer=True))
    init_weights(head, torch.Generator().manual_seed(0))
    head.norm.weight.data.copy_(load_causal_lm(demo_pair.target_dir).norm.weight)
    head.save(tmp_path / "head")
    endpoint = Endpoint.objects.create(name="local-vllm-eagle3", base_url="http://127.0.0.1:1", kind="vllm")
    draft = DraftModel.objects.create(name="demo-eagle3", kind="eagle_head", path=str(tmp_path / "head"))
    SpeculationPolicy.objects.create(endpoint=endpoint, mechanism="eagle_head", draft=draft, k=3)
    body = api.get(f"/api/v1/endpoints/{endpoint.pk}/native-flags/").json()
    assert body["speculative_config"] == {"method": "eagle3", "model": str(tmp_path / "head"),
                                          "num_speculative_tokens": 3}  # fmt: skip

    # when: vLLM starts with exactly those flags (served as the plain server's model) and answers greedy requests
    config = json.loads(body["args"][1])
    proc = processes.start_vllm(model_dir=demo_pair.target_dir, served_model_name=vllm_server.model,
                                log_dir=artifacts_dir, speculative_config=config)  # fmt: skip
    prompts = ["def parse_args(argv):\n    ", "class Stack:\n    def __init__(self):\n", "The quick brown fox"]
    try:
        before = spec_drafts_total(proc.url)
        answers = [_greedy(proc.url, vllm_server.model, prompt) for prompt in prompts]
        drafts = spec_drafts_total(proc.url) - before
    finally:
        proc.stop()

    # then: vLLM drafted with ACE's head, and its greedy answers are the plain server's
    assert drafts > 0, "vLLM reported no EAGLE-3 drafts"
    assert answers == [_greedy(vllm_server.base_url, vllm_server.model, prompt) for prompt in prompts]


def _greedy(base_url: str, model: str, prompt: str) -> str:
    response = httpx.post(f"{base_url}/v1/completions", timeout=300,
                          json={"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0})  # fmt: skip
    response.raise_for_status()
    return response.json()["choices"][0]["text"]
