"""The openai client through ACE in each mode, against the real vLLM, a real worker and real Redis.

Exactness claims pinned here (no tolerance: these are equalities):
- off: the bytes are the endpoint's own (ids and timestamps aside); no stage record.
- shadow: the response is identical to off; the greedy replay's drafted/accepted/passes equal what prod then
  actually does on the same requests with the same draft and K.
- prod (remote and local paths): greedy output token-identical to off.
"""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from speculation.models import StageRecord
from speculation.services.drafts import register_draft
from speculation.services.policies import update_policy
from tests.support.stack import register_probed_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.worker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
]
MAX_TOKENS = 24
K = 3


@pytest.fixture
def endpoint(vllm_server, demo_pair):
    return register_probed_endpoint(name="demo", base_url=vllm_server.base_url)


@pytest.fixture
def draft(demo_pair):
    return register_draft(name="demo-draft", kind="draft_model", path=str(demo_pair.draft_dir))


def _normalise(raw: bytes) -> bytes:
    return re.sub(rb'"(id|created)":("[^"]*"|\d+)', b'"\\1":_', raw)


def _direct(vllm_server, path: str, body: dict) -> bytes:
    return httpx.post(vllm_server.base_url + path, json={**body, "model": vllm_server.model}, timeout=120).content


def _through_ace(ace_server, token: str, path: str, body: dict, model: str) -> httpx.Response:
    return httpx.post(
        ace_server.url + path, json={**body, "model": model}, headers={"Authorization": f"Bearer {token}"}, timeout=120
    )


def _chat_tokens(client, model: str, prompt: str, *, stream: bool) -> tuple[list[int], str]:
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].model_extra["token_ids"], reply.choices[0].message.content
    ids: list[int] = []
    text = ""
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
            text += chunk.choices[0].delta.content or ""
    return ids, text


def _completion_tokens(client, model: str, prompt: str) -> tuple[list[int], str]:
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body={"return_token_ids": True}
    )
    return reply.choices[0].model_extra["token_ids"], reply.choices[0].text


def _records(endpoint, *, count: int, timeout_s: float = 90.0, **filters) -> list[StageRecord]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(StageRecord.objects.filter(endpoint=endpoint, **filters).order_by("id"))
        if len(found) >= count:
            return found
        time.sleep(0.3)
    raise AssertionError(f"expected {count} records {filters}, found {len(found)}")


def _wait_stored(endpoint, count: int, timeout_s: float = 30.0) -> None:
    """Until the endpoint's suffix store has taken this many answers (shadow stores after measuring)."""
    import redis
    from django.conf import settings

    from speculation.worker import suffix_store

    client = redis.Redis.from_url(settings.REDIS_URL)
    deadline = time.monotonic() + timeout_s
    while int(client.get(suffix_store.COUNT_KEY.format(endpoint_id=endpoint.pk)) or 0) < count:
        assert time.monotonic() < deadline, "shadow did not store the answer"
        time.sleep(0.1)


def _gateway_sees_it() -> None:
    """Until a policy change has reached the gateway process: it hears of it by a Redis push, and reads the
    counter itself at least every freshness.RECHECK_S (a request sent at once may still find the old route, which
    a user meets too, for at most that long; in CI a shadow request was once served as off)."""
    from speculation.gateway import freshness

    time.sleep(freshness.RECHECK_S + 0.5)


def _wait_background(endpoint, shadowed, timeout_s: float = 300.0) -> None:
    """Until the worker's background work on the shadowed request is done: its cost calibration (the record gets
    its projection) and the candidates' replays. A prod job waits behind a running background task (the worker
    runs one task at a time), and the gateway serves it plain after 5 s: right for a user, not what a test of the
    speculative path wants to see."""
    from speculation.models import CandidateMeasurement

    _records(endpoint, count=1, timeout_s=timeout_s, mode="shadow", multiplier__gt=0)
    deadline = time.monotonic() + timeout_s
    while not CandidateMeasurement.objects.filter(endpoint=endpoint, request_id=shadowed.request_id).exists():
        assert time.monotonic() < deadline, "the candidates of the shadowed request were not replayed"
        time.sleep(0.3)  # the rows are written together, as the replay ends


def test_off_mode_relays_the_endpoints_bytes_and_records_nothing(
    ace_server, token, vllm_server, endpoint, gateway_client
):
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8, "temperature": 0}
    for stream in (False, True):
        through = _through_ace(ace_server, token, "/v1/chat/completions", {**body, "stream": stream}, endpoint.name)
        assert through.status_code == 200
        assert re.fullmatch(r"[0-9a-f]{32}", through.headers["X-ACE-Request-Id"])
        direct = _direct(vllm_server, "/v1/chat/completions", {**body, "stream": stream})
        assert _normalise(through.content) == _normalise(direct)
    ids, _ = _chat_tokens(gateway_client, endpoint.name, PROMPTS[0], stream=True)
    assert len(ids) == MAX_TOKENS
    assert [m.id for m in gateway_client.models.list()] == ["demo"]
    assert not StageRecord.objects.exists()


def test_shadow_changes_nothing_and_its_replay_equals_what_prod_then_accepts(
    ace_server, token, vllm_server, endpoint, draft, celery_worker, gateway_client
):
    # given: off-mode outputs for the prompts
    off = {p: _chat_tokens(gateway_client, endpoint.name, p, stream=False) for p in PROMPTS}
    # when: shadow measures every request
    update_policy(endpoint=endpoint, mode="shadow", mechanism="draft_model", draft=draft, k=K, shadow_sample_rate=1.0)
    for prompt in PROMPTS:
        assert _chat_tokens(gateway_client, endpoint.name, prompt, stream=True) == off[prompt]
    raw_body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": MAX_TOKENS, "temperature": 0}
    shadow_raw = _through_ace(ace_server, token, "/v1/chat/completions", raw_body, endpoint.name).content
    assert _normalise(shadow_raw) == _normalise(_direct(vllm_server, "/v1/chat/completions", raw_body))
    shadow = _records(endpoint, count=len(PROMPTS) + 1, mode="shadow")
    assert {r.action for r in shadow} == {"would_speculate"}
    # and: the cost calibration ran on the worker's background queue (gpu.cpu.background, which the worker consumes
    # without being told), and every record made before it got its projection once it was stored
    projected = _records(endpoint, count=len(shadow), timeout_s=300.0, mode="shadow", multiplier__gt=0)
    assert "calibration pending" not in " ".join(r.reason for r in projected)
    # then: prod on the same requests, same draft and K, gives the same tokens and the same acceptance
    update_policy(endpoint=endpoint, mode="prod")
    for prompt in PROMPTS:
        assert _chat_tokens(gateway_client, endpoint.name, prompt, stream=False) == off[prompt]
    prod = _records(endpoint, count=len(PROMPTS), mode="prod")
    for replayed, actual in zip(shadow[: len(PROMPTS)], prod, strict=True):
        assert actual.action == "speculated", actual.reason
        assert actual.path == "remote"
        got = (actual.drafted_tokens, actual.accepted_tokens, actual.target_passes, actual.per_position_acceptance)
        want = (
            replayed.drafted_tokens,
            replayed.accepted_tokens,
            replayed.target_passes,
            replayed.per_position_acceptance,
        )
        assert got == want
        assert actual.acceptance_rate == replayed.acceptance_rate
    assert sum(r.accepted_tokens for r in prod) > 0  # the draft is distilled: something must be accepted
    assert all(r.baseline_tok_s and r.multiplier for r in prod)


def test_prod_remote_streams_the_same_tokens_as_off(endpoint, draft, celery_worker, gateway_client):
    off = {p: _chat_tokens(gateway_client, endpoint.name, p, stream=True) for p in PROMPTS[:2]}
    off_completion = _completion_tokens(gateway_client, endpoint.name, PROMPTS[2])
    update_policy(endpoint=endpoint, mode="prod", mechanism="draft_model", draft=draft, k=K)
    for prompt in PROMPTS[:2]:
        assert _chat_tokens(gateway_client, endpoint.name, prompt, stream=True) == off[prompt]
    assert _completion_tokens(gateway_client, endpoint.name, PROMPTS[2]) == off_completion
    records = _records(endpoint, count=3, mode="prod")
    assert [r.action for r in records] == ["speculated"] * 3
    # records come in request order: each counts exactly the tokens off produced for the same request
    want = [len(off[PROMPTS[0]][0]), len(off[PROMPTS[1]][0]), len(off_completion[0])]
    assert [r.output_tokens for r in records] == want


def test_prod_local_path_gives_the_same_tokens_as_off(endpoint, draft, demo_pair, celery_worker, gateway_client):
    off = {p: _chat_tokens(gateway_client, endpoint.name, p, stream=False) for p in PROMPTS[:2]}
    update_policy(
        endpoint=endpoint,
        mode="prod",
        mechanism="draft_model",
        draft=draft,
        k=K,
        path="local",
        target_path=str(demo_pair.target_dir),
    )
    for prompt in PROMPTS[:2]:
        assert _chat_tokens(gateway_client, endpoint.name, prompt, stream=True) == off[prompt]
    records = _records(endpoint, count=2, mode="prod")
    assert [(r.action, r.path) for r in records] == [("speculated", "local")] * 2


def test_prod_with_suffix_decoding_drafts_what_shadow_stored_and_gives_the_same_tokens_as_off(
    endpoint, demo_pair, celery_worker, gateway_client
):
    from speculation.worker import suffix_store

    # given: suffix decoding in shadow, its store empty; one request measured (the worker stores its answer)
    suffix_store.forget(endpoint.pk, redis_too=True)
    common = {"mechanism": "suffix", "k": K, "path": "local", "target_path": str(demo_pair.target_dir)}
    update_policy(endpoint=endpoint, mode="shadow", shadow_sample_rate=1.0, **common)
    off = _chat_tokens(gateway_client, endpoint.name, PROMPTS[1], stream=False)
    [shadowed] = _records(endpoint, count=1, mode="shadow")
    _wait_stored(endpoint, 1)
    # when: prod on the local path with suffix decoding, the same question again
    update_policy(endpoint=endpoint, mode="prod", **common)
    prod = _chat_tokens(gateway_client, endpoint.name, PROMPTS[1], stream=True)
    # then: the tokens of off; the worker drafted the stored answer and the target accepted most of it (the first
    # step finds nothing: the store holds answers, not prompts)
    assert prod == off
    [record] = _records(endpoint, count=1, mode="prod")
    assert (record.action, record.path, record.mechanism) == ("speculated", "local", "suffix")
    assert record.accepted_tokens >= 0.6 * record.drafted_tokens > 0  # a token the answer repeats can mislead
    # fewer target passes than tokens; how many fewer follows the K the batch loop's load-aware controller picks
    # from measured step times (on a busy machine it drafts less)
    assert record.target_passes < record.output_tokens
    # shadow's own replay had no earlier answer to draft from (its own left out)
    assert shadowed.accepted_tokens < record.accepted_tokens


@pytest.mark.parametrize("path", ["local", "remote"])
def test_prod_with_suffix_decoding_and_a_draft_fallback_gives_the_tokens_of_off_on_known_and_new_prompts(
    endpoint, draft, demo_pair, celery_worker, gateway_client, path
):
    from speculation.worker import suffix_store

    # given: the hybrid in shadow, its store empty; one request measured (the worker stores its answer), and one
    # answered in off (nothing stored)
    suffix_store.forget(endpoint.pk, redis_too=True)
    common = {"mechanism": "suffix_draft", "draft": draft, "k": K, "path": path}
    common["target_path"] = str(demo_pair.target_dir) if path == "local" else ""
    update_policy(endpoint=endpoint, mode="off", **common)
    off = {PROMPTS[2]: _chat_tokens(gateway_client, endpoint.name, PROMPTS[2], stream=False)}
    update_policy(endpoint=endpoint, mode="shadow", shadow_sample_rate=1.0)
    _gateway_sees_it()
    off[PROMPTS[1]] = _chat_tokens(gateway_client, endpoint.name, PROMPTS[1], stream=False)
    [shadowed] = _records(endpoint, count=1, mode="shadow")
    assert "suffix decoding with the draft's fallback" in shadowed.reason, shadowed.reason
    _wait_stored(endpoint, 1)
    _wait_background(endpoint, shadowed)
    # when: prod with the hybrid, a question answered before and one never seen
    update_policy(endpoint=endpoint, mode="prod", **common)
    _gateway_sees_it()
    prod = {p: _chat_tokens(gateway_client, endpoint.name, p, stream=True) for p in PROMPTS[1:]}
    # then: the tokens of off, both times
    assert prod == off
    known, new = _records(endpoint, count=2, mode="prod")
    assert {(r.action, r.path, r.mechanism) for r in (known, new)} == {("speculated", path, "suffix_draft")}
    # both speculated and saved target passes (how many depends on where the demo target's answer repeats the
    # stored one: 0.5-0.9 accepted across builds of the demo pair, so no level is pinned here)
    for record in (known, new):
        assert record.drafted_tokens > 0 and record.accepted_tokens > 0
        assert record.target_passes < record.output_tokens


def test_shadow_of_sampled_traffic_measures_suffix_decoding_and_the_hybrid(
    endpoint, draft, celery_worker, gateway_client
):
    from speculation.worker import suffix_store

    # given: suffix decoding in shadow on the remote path (no target in the worker), one greedy answer stored
    suffix_store.forget(endpoint.pk, redis_too=True)
    update_policy(endpoint=endpoint, mode="shadow", shadow_sample_rate=1.0, mechanism="suffix", k=K, path="remote")
    _gateway_sees_it()
    _chat_tokens(gateway_client, endpoint.name, PROMPTS[1], stream=False)
    _wait_stored(endpoint, 1)
    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 7, "max_tokens": MAX_TOKENS}
    messages = [{"role": "user", "content": PROMPTS[1]}]
    # when: the same question, sampled
    reply = gateway_client.chat.completions.create(model=endpoint.name, messages=messages, **sampled)
    assert reply.choices[0].message.content
    # then: shadow replayed suffix decoding against the sampled answer (exact), drafting from the stored one
    records = _records(endpoint, count=2, mode="shadow")
    suffix = records[1]
    assert suffix.action == "would_speculate" and "sampled (temperature 0.8" in suffix.reason, suffix.reason
    assert "replayed against the sampled output (exact" in suffix.reason
    assert suffix.drafted_tokens > 0 and suffix.target_passes > 0
    # and with the hybrid: its expected counts, the draft's probability of passing read from the server's top-20
    # log-probabilities (top_k 0: the lower bound sum_x min(p, q) per position)
    update_policy(endpoint=endpoint, mechanism="suffix_draft", draft=draft)
    _gateway_sees_it()
    gateway_client.chat.completions.create(model=endpoint.name, messages=messages, **sampled)
    hybrid = _records(endpoint, count=3, mode="shadow")[2]
    assert hybrid.mechanism == "suffix_draft" and "the draft's steps expected" in hybrid.reason, hybrid.reason
    assert "lower bound from the server's top-" in hybrid.reason
    assert hybrid.drafted_tokens > 0 and hybrid.mean_accepted_len > 1.0 and hybrid.alpha is not None


@pytest.fixture
def eagle_head(demo_pair, tmp_path):
    """The demo target's EAGLE head: the trained one when the demo build made it, else one saved untrained for the
    demo target (its drafts are verified like any other), with the target's tokenizer as the registry asks."""
    import shutil

    import torch

    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights
    from speculation.offline.eagle.demo_head import default_head_dir

    head_dir = default_head_dir(demo_pair)
    if not (head_dir / "config.json").is_file():
        head = EagleHead(EagleConfig.for_target(demo_pair.target_dir))
        init_weights(head, torch.Generator().manual_seed(0))
        head_dir = head.save(tmp_path / "demo-eagle")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (demo_pair.target_dir / name).is_file():
                shutil.copyfile(demo_pair.target_dir / name, head_dir / name)
    return register_draft(name="demo-eagle", kind="eagle_head", path=str(head_dir))


def test_prod_local_path_with_an_eagle_head_gives_the_same_tokens_as_off(
    endpoint, eagle_head, demo_pair, celery_worker, gateway_client
):
    off = {p: _chat_tokens(gateway_client, endpoint.name, p, stream=False) for p in PROMPTS[:2]}
    update_policy(
        endpoint=endpoint,
        mode="prod",
        mechanism="eagle_head",
        draft=eagle_head,
        k=K,
        path="local",
        target_path=str(demo_pair.target_dir),
    )
    for prompt in PROMPTS[:2]:
        assert _chat_tokens(gateway_client, endpoint.name, prompt, stream=True) == off[prompt]
    records = _records(endpoint, count=2, mode="prod")
    assert [(r.action, r.path, r.mechanism) for r in records] == [("speculated", "local", "eagle_head")] * 2
    assert all(r.drafted_tokens > 0 for r in records)  # the head drafted; the target checked every draft


def test_prod_sends_requests_it_cannot_serve_exactly_plain_with_the_reason(
    endpoint, draft, celery_worker, gateway_client
):
    update_policy(endpoint=endpoint, mode="prod", mechanism="draft_model", draft=draft, k=K)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    gateway_client.chat.completions.create(model=endpoint.name, messages=messages, max_tokens=4, temperature=0.8)
    gateway_client.chat.completions.create(
        model=endpoint.name, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    with pytest.raises(openai.BadRequestError):  # vLLM refuses n=2 when greedy; its 400 comes back unchanged
        gateway_client.chat.completions.create(model=endpoint.name, messages=messages, max_tokens=4, temperature=0, n=2)
    with pytest.raises(openai.BadRequestError):  # vLLM refuses it too, with its own 400
        gateway_client.chat.completions.create(model=endpoint.name, messages=messages, max_tokens=5000, temperature=0)
    records = _records(endpoint, count=4, mode="prod")
    assert [r.action for r in records] == ["skipped"] * 4
    reasons = [r.reason for r in records]
    assert "temperature 0.8" in reasons[0]
    assert "logprobs" in reasons[1]
    assert "n > 1" in reasons[2]
    assert "too long" in reasons[3]


def test_a_mode_switch_applies_to_the_next_request(endpoint, draft, celery_worker, gateway_client):
    _chat_tokens(gateway_client, endpoint.name, PROMPTS[0], stream=False)
    update_policy(endpoint=endpoint, mode="prod", mechanism="draft_model", draft=draft, k=K)
    _chat_tokens(gateway_client, endpoint.name, PROMPTS[0], stream=False)
    update_policy(endpoint=endpoint, mode="off")
    _chat_tokens(gateway_client, endpoint.name, PROMPTS[0], stream=False)
    time.sleep(1.0)
    assert [r.mode for r in StageRecord.objects.filter(endpoint=endpoint)] == ["prod"]


def test_unknown_models_and_bad_tokens_get_openai_errors(ace_server, gateway_client, endpoint):
    with pytest.raises(openai.NotFoundError):
        gateway_client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=ace_server.url + "/v1", api_key="not-a-token", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
