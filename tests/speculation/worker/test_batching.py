"""The worker's batch loop: concurrent local-path prod requests served together, each exactly as alone.

Equalities (no tolerance): 32 prod jobs handed to one process at once (the Celery task body, real Redis, the
Redis channel as the gateway reads it) are all answered, greedy and seeded ones token-identical to the same
jobs with batching off. A cancelled request leaves the batch; a failing batch step fails its requests with a
reason (the gateway falls back) and the loop serves the next ones.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from speculation.engine import DraftModelProposer, HybridProposer, LocalTarget, NgramProposer, SuffixProposer
from speculation.engine.batch import BatchDecoder
from speculation.jobs.admission import inflight_key
from speculation.jobs.channel import key as channel_key
from speculation.worker import batching
from speculation.worker.generation import Prepared, speculate
from speculation.worker.paths import resources
from tests.speculation.worker.conftest import local_prod_endpoint
from tests.support.models import draft_of, tiny_model

SLOTS = 32


def _save_like(tiny_model_dir: Path, out: Path, *, seed: int, noise: float) -> Path:
    """The tiny model directory's tokenizer with decisive random weights (std 0.5: greedy argmaxes are not
    near-ties), plus noise: the draft is the target with noise, so it is often but not always accepted."""
    from transformers import LlamaConfig, LlamaForCausalLM

    for path in tiny_model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, out / path.name)
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.initializer_range = 0.5
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * noise * p.std())
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory) -> tuple[str, str]:
    target = _save_like(tiny_model_dir, tmp_path_factory.mktemp("batch-target"), seed=0, noise=0.0)
    draft = _save_like(tiny_model_dir, tmp_path_factory.mktemp("batch-draft"), seed=1, noise=0.05)
    return str(target), str(draft)


def _fresh_loop(settings, monkeypatch, *, load_aware_k: bool):
    settings.PROD_BATCH_SLOTS = SLOTS
    loop = batching.BatchLoop(slots=SLOTS, load_aware_k=load_aware_k)
    monkeypatch.setattr(batching, "_the_loop", loop)
    yield loop
    loop.stop()


@pytest.fixture
def batch_loop(settings, monkeypatch):
    """Batching on, with a fresh loop for this test."""
    yield from _fresh_loop(settings, monkeypatch, load_aware_k=True)


@pytest.fixture
def fixed_k_loop(settings, monkeypatch):
    """Batching on, a fresh loop drafting each request's K (ACE_BATCH_LOAD_AWARE_K off)."""
    yield from _fresh_loop(settings, monkeypatch, load_aware_k=False)


@pytest.fixture
def local_endpoint(transactional_db, client, model_dirs):
    target_dir, draft_dir = model_dirs
    endpoint, _ = local_prod_endpoint(client, name="batched", target_dir=target_dir, draft_dir=draft_dir)
    return endpoint


def _jobs(endpoint, client) -> list[dict]:
    """32 jobs: prompts of 1 to 32 tokens, 8 to 39 new tokens; every fourth sampled with its own seed."""
    jobs = []
    for i in range(SLOTS):
        sampling = {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "seed": 100 + i} if i % 4 == 3 else None
        request_id = f"batch-{i}-{time.monotonic_ns()}"
        client.zadd(inflight_key("cpu"), {request_id: time.time() + 120})  # the gateway admitted it
        jobs.append(
            {
                "request_id": request_id,
                "endpoint_id": endpoint.pk,
                "prompt_ids": [(7 * i + j) % 290 + 3 for j in range(i + 1)],
                "max_tokens": 8 + i,
                "k": 2 + i % 3,
                "path": "local",
                "sampling": sampling,
                "stop": {"ignore_eos": True},
                "node_class": "cpu",
            }
        )
    return jobs


def _messages(client, request_id: str) -> list[dict]:
    return [json.loads(m) for m in client.lrange(channel_key(request_id), 0, -1)]


def _answer(client, request_id: str, timeout_s: float = 300.0) -> tuple[list[int], dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        messages = _messages(client, request_id)
        if messages and messages[-1]["type"] in ("done", "error", "cancelled"):
            ids = [t for m in messages if m["type"] == "tokens" for t in m["ids"]]
            return ids, messages[-1]
        assert time.monotonic() < deadline, f"{request_id} not answered: {messages[-3:]}"
        time.sleep(0.05)


def _step_sizes(monkeypatch) -> list[int]:
    """The number of slots each batch step serves, from now on (BatchDecoder.step wrapped)."""
    sizes: list[int] = []
    step = BatchDecoder.step

    def counting_step(self):
        sizes.append(len(self))
        return step(self)

    monkeypatch.setattr(BatchDecoder, "step", counting_step)
    return sizes


def test_32_concurrent_prod_jobs_are_all_answered_and_equal_to_batching_off(
    local_endpoint, client, batch_loop, settings, monkeypatch
):
    from speculation.worker.generation import run_prod_generation
    from speculation.worker.tasks import prod_generate_task

    # given: each job's tokens with batching off (one engine loop per job, as before)
    settings.PROD_BATCH_SLOTS = 0
    alone = {}
    for job in _jobs(local_endpoint, client):
        run_prod_generation(job)
        alone[job["prompt_ids"][0], len(job["prompt_ids"])] = _answer(client, job["request_id"])[0]
    settings.PROD_BATCH_SLOTS = SLOTS
    # and a batch loop that records how many slots each step served
    sizes = _step_sizes(monkeypatch)
    # when: 32 jobs reach the process at once (the Celery task body hands each to the batch loop and returns)
    jobs = _jobs(local_endpoint, client)
    for job in jobs:
        prod_generate_task(job)
    answers = [_answer(client, job["request_id"]) for job in jobs]
    # then: every job is done, with the tokens it gets alone (greedy and seeded alike), its slot released
    for job, (ids, last) in zip(jobs, answers, strict=True):
        assert last["type"] == "done", last
        assert ids == alone[job["prompt_ids"][0], len(job["prompt_ids"])], job["request_id"]
        assert len(ids) == job["max_tokens"]
        assert client.zscore(inflight_key("cpu"), job["request_id"]) is None
    assert sum(last["stats"]["accepted_tokens"] for _, last in answers) > 0
    # served together: the task body returned at once, so later jobs joined while earlier ones ran
    assert max(sizes) >= 4, sizes


def test_suffix_decoding_drafts_a_later_request_from_an_earlier_answer_through_redis(
    local_endpoint, client, batch_loop
):
    from speculation.models import SpeculationPolicy
    from speculation.worker import suffix_store
    from speculation.worker.generation import run_prod_generation
    from speculation.worker.tasks import prod_generate_task

    # given: the endpoint's policy drafts by suffix decoding, its store empty
    SpeculationPolicy.objects.filter(endpoint=local_endpoint).update(mechanism="suffix", draft=None, k=6)
    suffix_store.forget(local_endpoint.pk, redis_too=True)
    job = _jobs(local_endpoint, client)[20]  # greedy, 21 prompt tokens, 28 new tokens
    job["k"] = 6
    # when: the request runs in the batch loop, then again (a new request id) after this process forgot its store
    # (as another worker process would: it reads the first answer from Redis)
    prod_generate_task(job)
    first, done_first = _answer(client, job["request_id"])
    suffix_store.forget(local_endpoint.pk)
    again = {**job, "request_id": job["request_id"] + "-again"}
    client.zadd(inflight_key("cpu"), {again["request_id"]: time.time() + 120})
    prod_generate_task(again)
    second, done_second = _answer(client, again["request_id"])
    # and once more with batching off (the single-stream loop drafts from the same store)
    batch_loop.stop()
    alone = {**job, "request_id": job["request_id"] + "-alone"}
    client.zadd(inflight_key("cpu"), {alone["request_id"]: time.time() + 120})
    with override_slots(0):
        run_prod_generation(alone)
    third, done_third = _answer(client, alone["request_id"])
    # then: the same tokens each time; the later requests drafted the earlier answer and it was accepted
    assert done_first["type"] == done_second["type"] == done_third["type"] == "done"
    assert first == second == third and len(first) == job["max_tokens"]
    stats = [d["stats"] for d in (done_first, done_second, done_third)]
    assert stats[1]["accepted_tokens"] >= 0.8 * stats[1]["drafted_tokens"] > 0
    assert stats[1]["target_passes"] * 2 <= stats[0]["target_passes"]
    assert stats[2]["target_passes"] * 2 <= stats[0]["target_passes"]


def test_the_hybrid_serves_concurrent_jobs_in_the_batch_exactly_and_drafts_from_earlier_answers(
    local_endpoint, client, fixed_k_loop, settings, monkeypatch
):
    from speculation.models import SpeculationPolicy
    from speculation.worker import suffix_store
    from speculation.worker.generation import run_prod_generation
    from speculation.worker.tasks import prod_generate_task

    # given (fixed_k_loop): a batch loop drafting the policy's K (the load-aware controller's choices are tested in
    # the engine; here the draft's K 2 and the lookup's 8, as the single-stream loop drafts them)
    # and suffix decoding with the draft's fallback (the draft's K 2), its store empty; 8 jobs (2 sampled)
    SpeculationPolicy.objects.filter(endpoint=local_endpoint).update(mechanism="suffix_draft", k=2)
    suffix_store.forget(local_endpoint.pk, redis_too=True)

    def wave(tag: str) -> list[dict]:
        jobs = _jobs(local_endpoint, client)[12:20]
        for job in jobs:
            job.update(request_id=f"{job['request_id']}-{tag}", k=2)
            client.zadd(inflight_key("cpu"), {job["request_id"]: time.time() + 120})
        return jobs

    # and each job's tokens with batching off (single-stream HybridProposer), the store then forgotten again
    settings.PROD_BATCH_SLOTS = 0
    alone = {}
    for job in wave("alone"):
        run_prod_generation(job)
        alone[len(job["prompt_ids"])] = _answer(client, job["request_id"])[0]
    suffix_store.forget(local_endpoint.pk, redis_too=True)
    settings.PROD_BATCH_SLOTS = SLOTS
    sizes = _step_sizes(monkeypatch)
    # when: the 8 jobs reach the process at once, twice (the second wave finds the first's answers in the store)
    answers = {}
    for tag in ("first", "second"):
        jobs = wave(tag)
        for job in jobs:
            prod_generate_task(job)
        answers[tag] = [(job, *_answer(client, job["request_id"])) for job in jobs]
    # then: every job done with max_tokens tokens, the greedy ones those of batching off, served together
    for tag, answered in answers.items():
        for job, ids, last in answered:
            assert last["type"] == "done", (tag, last)
            assert len(ids) == job["max_tokens"]
            if job["sampling"] is None:
                assert ids == alone[len(job["prompt_ids"])], (tag, job["request_id"])
    assert max(sizes) >= 4, sizes
    # the second wave's greedy jobs drafted from the store: steps wider than the draft's K 2 (only a lookup
    # drafts more), and most of their drafts accepted
    second = [last["stats"] for job, _, last in answers["second"] if job["sampling"] is None]
    assert all(len(stats["per_position_acceptance"]) > 2 for stats in second)
    assert sum(st["accepted_tokens"] for st in second) >= 0.7 * sum(st["drafted_tokens"] for st in second) > 0
    greedy_tokens = sum(len(ids) for job, ids, _ in answers["second"] if job["sampling"] is None)
    assert sum(st["target_passes"] for st in second) * 2 <= greedy_tokens


def override_slots(slots: int):
    from django.test import override_settings

    return override_settings(PROD_BATCH_SLOTS=slots)


def _prepared(model_dirs, *, ngram: bool = False) -> Prepared:
    target = resources.model(model_dirs[0]).model
    proposer = (
        NgramProposer() if ngram else DraftModelProposer(resources.model(model_dirs[1]).model, target_vocab_size=300)
    )
    return Prepared(proposer=proposer, tokenizer=None, eos_ids=frozenset(), target=LocalTarget(target))


def _run(prepared, prompt: list[int], *, batch: bool, on_tokens=None, max_tokens: int = 40) -> list[int]:
    out: list[int] = []

    def collect(ids: list[int]) -> None:
        out.extend(ids)
        if on_tokens is not None:
            on_tokens(ids)

    speculate(prepared, prompt_ids=prompt, max_tokens=max_tokens, k=3, on_tokens=collect, batch=batch)
    return out


def test_a_prompt_seen_before_reuses_the_finished_requests_rows_and_answers_the_same(model_dirs, batch_loop):
    # given a request that ran through the batch loop
    prepared = _prepared(model_dirs)
    prompt = [(5 * j) % 290 + 3 for j in range(40)]
    first = _run(prepared, prompt, batch=True)
    # when the same prompt comes again, then one that shares its first 30 tokens
    again = _run(prepared, prompt, batch=True)
    shared = prompt[:30] + [7, 8, 9]
    diverging = _run(prepared, shared, batch=True)
    # then both were served from the prefix cache (the loop's decoder for the pair), with what each gets alone
    (group,) = batch_loop._groups.values()
    assert group.decoder.prefix_cache.hits == 2
    assert first == again == _run(prepared, prompt, batch=False)
    assert diverging == _run(prepared, shared, batch=False)


@pytest.mark.parametrize("ngram", [False, True])
def test_a_request_that_leaves_early_frees_its_slot_and_the_others_finish_exactly(model_dirs, batch_loop, ngram):
    # given three concurrent requests; the second one's client goes away after its second step
    from speculation.jobs.admission import Cancelled

    prepared = _prepared(model_dirs, ngram=ngram)
    prompts = [[5, 6, 7, 5, 6, 7], [9, 10], [11, 12, 13, 14]]
    want = [_run(prepared, p, batch=False) for p in prompts]
    steps = []

    def cancel_after_two(ids: list[int]) -> None:
        steps.append(ids)
        if len(steps) == 2:
            raise Cancelled("client went away")

    results: dict[int, object] = {}

    def serve(i: int) -> None:
        try:
            results[i] = _run(prepared, prompts[i], batch=True, on_tokens=cancel_after_two if i == 1 else None)
        except Cancelled as exc:
            results[i] = exc

    # when
    threads = [threading.Thread(target=serve, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    # then
    assert results[0] == want[0] and results[2] == want[2]
    assert isinstance(results[1], Cancelled) and len(steps) == 2
    _wait_until(lambda: all(not len(g.decoder) for g in batch_loop._groups.values()))


def _wait_until(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_a_failing_batch_step_fails_its_requests_with_the_reason_and_the_loop_serves_the_next(
    model_dirs, batch_loop, monkeypatch
):
    prepared = _prepared(model_dirs)
    want = _run(prepared, [3, 4, 5], batch=False)
    step = BatchDecoder.step
    monkeypatch.setattr(BatchDecoder, "step", lambda self: (_ for _ in ()).throw(RuntimeError("CUDA error: boom")))
    with pytest.raises(batching.BatchFailed, match="batch error: RuntimeError: CUDA error: boom"):
        _run(prepared, [3, 4, 5], batch=True)
    monkeypatch.setattr(BatchDecoder, "step", step)
    assert _run(prepared, [3, 4, 5], batch=True) == want


def test_a_worker_declares_its_batch_slots_to_admission_control(settings):
    settings.PROD_BATCH_SLOTS = 24
    assert batching.capacity(2) == 48
    assert batching.takes({"path": "local"}) and not batching.takes({"path": "remote"})
    settings.PROD_BATCH_SLOTS = 0
    assert batching.capacity(2) == 2
    assert not batching.takes({"path": "local"})


def test_each_decoder_gets_a_prefix_cache_of_the_configured_size(settings):
    settings.PROD_PREFIX_CACHE_MB = 3
    assert batching.prefix_cache().max_bytes == 3 * 2**20
    settings.PROD_PREFIX_CACHE_MB = 0
    assert batching.prefix_cache() is None


def test_the_batch_serves_draft_models_lookups_and_the_hybrid_on_the_local_path_only(settings):
    settings.PROD_BATCH_SLOTS = 4
    target = tiny_model(seed=0)
    local = LocalTarget(target)
    assert batching.serves(Prepared(proposer=NgramProposer(), tokenizer=None, eos_ids=frozenset(), target=local))
    assert batching.serves(Prepared(proposer=SuffixProposer(), tokenizer=None, eos_ids=frozenset(), target=local))
    draft = DraftModelProposer(draft_of(target), target_vocab_size=target.vocab_size)
    assert batching.serves(Prepared(proposer=draft, tokenizer=None, eos_ids=frozenset(), target=local))
    hybrid = HybridProposer(SuffixProposer(), draft, model_k=2)  # suffix decoding with the draft's fallback
    assert batching.serves(Prepared(proposer=hybrid, tokenizer=None, eos_ids=frozenset(), target=local))
    assert not batching.serves(Prepared(proposer=draft, tokenizer=None, eos_ids=frozenset()))  # remote path
    assert not batching.serves(Prepared(proposer=hybrid, tokenizer=None, eos_ids=frozenset()))
    assert not batching.serves(Prepared(proposer=object(), tokenizer=None, eos_ids=frozenset(), target=local))


def test_it_serves_a_model_transformers_runs_for_ace_at_batch_one(settings):
    # given a target and a draft that run through transformers' model (implementation "generic")
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from speculation.engine.generic import GenericCausalLM

    settings.PROD_BATCH_SLOTS = 4
    config = GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, max_position_embeddings=64)  # fmt: skip
    generic = GenericCausalLM(GPTNeoXForCausalLM(config).eval(), max_positions=64)
    native = tiny_model(seed=0)
    draft = DraftModelProposer(generic, target_vocab_size=64)
    # then: neither joins the batch loop (each request runs alone), while n-gram lookup on a native target does
    assert not batching.serves(
        Prepared(proposer=draft, tokenizer=None, eos_ids=frozenset(), target=LocalTarget(generic))
    )
    hybrid = HybridProposer(SuffixProposer(), draft, model_k=2)
    assert not batching.serves(
        Prepared(proposer=hybrid, tokenizer=None, eos_ids=frozenset(), target=LocalTarget(native))
    )
    assert batching.serves(
        Prepared(proposer=NgramProposer(), tokenizer=None, eos_ids=frozenset(), target=LocalTarget(native))
    )


def test_the_stored_calibration_seeds_the_pairs_k_at_load_one(model_dirs, batch_loop, monkeypatch):
    from dataclasses import replace

    from speculation.engine.lookahead import LoadAwareLookahead
    from speculation.engine.projection import StepCosts

    chosen: list[int] = []
    choose = LoadAwareLookahead.choose

    def spy(self, *args, **kwargs) -> int:
        chosen.append(choose(self, *args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(LoadAwareLookahead, "choose", spy)
    # given: a request whose path has a stored calibration (verifying up to 3 tokens as cheap as one)
    stored = StepCosts(target_step_s=0.01, draft_step_s=0.0001, verify_s={1: 0.004, 3: 0.004, 9: 0.02})
    prepared = replace(_prepared(model_dirs), costs=stored)
    want = _run(prepared, [3, 4, 5], batch=True)
    assert want == _run(prepared, [3, 4, 5], batch=False)
    # then: the pair's controller started at load 1 from those costs: its first step drafts the best K for them
    # (2), no learning steps
    (group,) = batch_loop._groups.values()
    assert set(stored.verify_s) <= set(group.decoder.lookahead.by_load[1].verify_s)
    assert chosen[0] == 2
    # whereas a fresh pair without a calibration learns: K = 3 twice (the first is its warm-up), 1 twice, 0 twice
    batch_loop._groups.clear()
    chosen.clear()
    assert _run(replace(prepared, costs=None), [3, 4, 5], batch=True) == want
    assert chosen[:6] == [3, 3, 1, 1, 0, 0]


def test_work_handed_to_the_loop_runs_in_its_thread_and_returns_or_raises(batch_loop):
    # the calibration of the batched path times its steps there (batching.on_loop_thread)
    assert batching.on_loop_thread(lambda: threading.current_thread().name) == "ace-batch-loop"
    with pytest.raises(ZeroDivisionError):
        batching.on_loop_thread(lambda: 1 / 0)
    assert batching.on_loop_thread(lambda: 42) == 42  # the loop goes on
