"""Sampled prod, admission control and cancellation through the gateway: the openai client against ACE, a
real vLLM, a real worker and real Redis.

- local path at temperature 0.7, top-p 0.9: the first output token (accepted draft, recovered or bonus token of
  the first verification) is distributed as the target's processed distribution, computed here from the demo
  target's own logits. Pearson chi-square, rejected at p < 1e-3 (false-alarm rate 0.1 %); the same counts
  must be rejected against the unprocessed distribution (temperature 1, no top-p), so a worker that ignored
  the request's sampling would fail. The residual-sampling bug is caught by the engine-level tests
  (tests/speculation/test_prod_worker.py, tests/speculation/engine/test_engine_sampling.py).
- the same seed gives the same text, on the local and the remote path (remote: top_k below max logprobs).
- 32 concurrent prod requests (different prompts; a quarter sampled) are all answered, the greedy ones
  token-identical to off: several speculated together by the worker's batch loop (ACE_BATCH_SLOTS, 8 by
  default: one prefork process serving one request at a time would make the others wait past the start
  timeout, fell_back), the rest skipped at once "worker at capacity", none fell_back.
- a client that disconnects from a prod stream stops the worker's generation, the record says so, and the
  next prod request is speculated.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis
import torch

from speculation.models import StageRecord
from speculation.services.drafts import register_draft
from speculation.services.policies import update_policy
from tests.support.stack import register_probed_endpoint
from tests.support.stats import chi2_critical, chi2_statistic

pytestmark = [pytest.mark.vllm, pytest.mark.worker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PROMPT = "import"
SAMPLES = 300


@pytest.fixture
def endpoint(vllm_server, demo_pair):
    return register_probed_endpoint(name="demo-sampling", base_url=vllm_server.base_url)


@pytest.fixture
def draft(demo_pair):
    return register_draft(name="demo-draft-sampling", kind="draft_model", path=str(demo_pair.draft_dir))


def _prod(endpoint, draft, demo_pair, *, path: str = "local", k: int = 3) -> None:
    update_policy(
        endpoint=endpoint,
        mode="prod",
        mechanism="draft_model",
        draft=draft,
        k=k,
        path=path,
        target_path=str(demo_pair.target_dir),
    )


def _records(endpoint, *, count: int, timeout_s: float = 90.0) -> list[StageRecord]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(StageRecord.objects.filter(endpoint=endpoint, mode="prod").order_by("id"))
        if len(found) >= count:
            return found
        time.sleep(0.3)
    raise AssertionError(f"expected {count} prod records, found {len(found)}")


def _warm(client, endpoint) -> None:
    """Until the worker has served a prod request (models loaded), then forget the warm-up records."""
    for _ in range(30):
        client.completions.create(model=endpoint.name, prompt=PROMPT, max_tokens=2, temperature=0)
        if _records(endpoint, count=1)[-1].action == "speculated":
            break
    StageRecord.objects.filter(endpoint=endpoint).delete()


def _processed_and_raw(demo_pair, prompt_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    from speculation.engine import SamplingParams, load_causal_lm, probs_from_logits

    model = load_causal_lm(str(demo_pair.target_dir))
    with torch.inference_mode():
        logits = model(torch.tensor(prompt_ids), 0).logits[-1].float()
    return probs_from_logits(logits, SamplingParams(temperature=0.7, top_p=0.9)), torch.softmax(logits, -1)


def test_prod_local_sampling_follows_the_targets_processed_distribution(
    endpoint, draft, demo_pair, celery_worker, gateway_client
):
    # given the prompt as token ids (no tokenizer in between) and its exact processed next-token distribution
    from transformers import AutoTokenizer

    prompt_ids = AutoTokenizer.from_pretrained(demo_pair.target_dir)(PROMPT)["input_ids"]
    processed, raw = _processed_and_raw(demo_pair, prompt_ids)
    assert 0.5 * (processed - raw).abs().sum() > 0.1  # temperature and top-p matter here: the check has power
    _prod(endpoint, draft, demo_pair)
    _warm(gateway_client, endpoint)
    # when: SAMPLES requests, one seed each
    counts = torch.zeros_like(processed)
    for seed in range(SAMPLES):
        reply = gateway_client.completions.create(
            model=endpoint.name,
            prompt=prompt_ids,
            max_tokens=2,
            temperature=0.7,
            top_p=0.9,
            seed=seed,
            extra_body={"return_token_ids": True},
        )
        counts[reply.choices[0].model_extra["token_ids"][0]] += 1
    # then: every one was speculated on the local path, with drafts verified by rejection sampling
    records = _records(endpoint, count=SAMPLES)
    assert {(r.action, r.path) for r in records} == {("speculated", "local")}
    assert sum(r.drafted_tokens for r in records) >= SAMPLES
    # and the first tokens follow the processed distribution, not the raw one
    stat, dof = chi2_statistic(counts, processed)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} >= {chi2_critical(dof):.1f} (dof {dof})"
    stat, dof = chi2_statistic(counts, raw)
    assert stat >= chi2_critical(dof), f"the unprocessed distribution passed: chi2 {stat:.1f} (dof {dof})"


@pytest.mark.parametrize(("path", "extra"), [("local", {}), ("remote", {"top_k": 5})])
def test_the_same_seed_gives_the_same_text(endpoint, draft, demo_pair, celery_worker, gateway_client, path, extra):
    _prod(endpoint, draft, demo_pair, path=path)

    def text(seed: int) -> str:
        return (
            gateway_client.chat.completions.create(
                model=endpoint.name,
                messages=[{"role": "user", "content": "def parse(line):"}],
                max_tokens=24,
                temperature=0.7,
                top_p=0.9,
                seed=seed,
                extra_body=extra,
            )
            .choices[0]
            .message.content
        )

    first = text(7)
    assert text(7) == first
    others = {text(seed) for seed in (8, 9, 10)}
    assert others != {first}  # the seed matters: samples differ
    records = _records(endpoint, count=5)
    assert {(r.action, r.path) for r in records} == {("speculated", path)}


def test_remote_sampling_without_a_known_top_k_goes_plain_with_the_reason(
    endpoint, draft, demo_pair, celery_worker, gateway_client
):
    _prod(endpoint, draft, demo_pair, path="remote")
    gateway_client.completions.create(model=endpoint.name, prompt=PROMPT, max_tokens=4, temperature=0.7, top_p=0.9)
    gateway_client.completions.create(
        model=endpoint.name, prompt=PROMPT, max_tokens=4, temperature=0.7, extra_body={"top_k": 50}
    )
    records = _records(endpoint, count=2)
    assert [r.action for r in records] == ["skipped", "skipped"]
    assert "no top_k on the remote path" in records[0].reason
    assert "top_k=50" in records[1].reason


CONCURRENT_PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main():", "class Stack:", "for i in"]


def test_32_concurrent_prod_requests_are_all_answered_together(
    endpoint, draft, demo_pair, celery_worker, gateway_client, ace_server, token
):
    # given 32 requests: 4 prompts x 8 lengths; every fourth sampled (temperature 0.7, top_p 0.9) with a seed
    headers = {"Authorization": f"Bearer {token}"}

    def body(i: int) -> dict:
        found = {"model": endpoint.name, "prompt": CONCURRENT_PROMPTS[i % 4], "max_tokens": 16 + i, "temperature": 0}
        return {**found, "temperature": 0.7, "top_p": 0.9, "seed": i} if i % 4 == 3 else found

    def ask(i: int) -> httpx.Response:
        return httpx.post(ace_server.url + "/v1/completions", json=body(i), headers=headers, timeout=300)

    off = {i: ask(i).json()["choices"][0]["text"] for i in range(32) if i % 4 != 3}
    _prod(endpoint, draft, demo_pair)
    _warm(gateway_client, endpoint)
    # when: 32 at once
    with ThreadPoolExecutor(max_workers=32) as pool:
        replies = list(pool.map(ask, range(32)))
    # then: all answered, the greedy ones with off's text; several speculated at once (the batch's slots), the
    # rest plain at once, none after waiting
    assert [r.status_code for r in replies] == [200] * 32
    assert {i: replies[i].json()["choices"][0]["text"] for i in off} == off
    records = _records(endpoint, count=32)
    actions = [r.action for r in records]
    assert actions.count("fell_back") == 0, [r.reason for r in records if r.action == "fell_back"]
    assert actions.count("speculated") >= 2
    skipped = [r.reason for r in records if r.action == "skipped"]
    assert all(reason.startswith("worker at capacity") for reason in skipped), skipped


def test_a_client_that_disconnects_stops_the_worker(
    endpoint, draft, demo_pair, celery_worker, gateway_client, ace_server, token, redis_server
):
    from speculation.jobs.channel import key

    _prod(endpoint, draft, demo_pair, k=1)
    _warm(gateway_client, endpoint)
    max_tokens = 1000  # the demo server's context is 1024
    body = {
        "model": endpoint.name,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    # when: the client reads the first chunks of the stream and hangs up
    with httpx.stream(
        "POST",
        ace_server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        request_id = response.headers["X-ACE-Request-Id"]
        for i, _ in enumerate(response.iter_lines()):
            if i >= 4:
                break
    # then: the worker stops long before max_tokens and says so on the channel; the record says why
    client = redis.Redis.from_url(redis_server.url)
    deadline = time.monotonic() + 60
    last = None
    while time.monotonic() < deadline:
        messages = [json.loads(m) for m in client.lrange(key(request_id), 0, -1)]
        last = messages[-1] if messages else None
        if last and last["type"] in ("cancelled", "done"):
            break
        time.sleep(0.1)
    assert last is not None and last["type"] == "cancelled", last
    assert last["tokens"] < max_tokens
    record = _records(endpoint, count=1)[0]
    assert record.action == "fell_back"
    assert "client went away" in record.reason and "told to stop" in record.reason
    # and the worker is free for the next prod request
    gateway_client.completions.create(model=endpoint.name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert _records(endpoint, count=2)[1].action == "speculated"
