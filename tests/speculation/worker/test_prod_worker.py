"""The prod worker's side of sampling, admission and cancellation, on tiny models and a real Redis.

- sampling: the job's temperature / top-k / top-p / seed reach the engine's exact rejection sampling on the
  local path: the output follows the target's processed distribution (chi-square against exact enumeration,
  rejected at p < 1e-3; the same check rejects a wrong sampler), and the same seed gives the same tokens.
- admission: slots per node class against the capacity workers declare; a full class says so at once.
- cancellation: a job whose client went away stops within one step and frees its slot; a job cancelled
  before it started never starts.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from speculation.engine import DraftModelProposer, LocalTarget
from speculation.engine import batch as step_module
from speculation.jobs.admission import Cancelled, CapacityHeartbeat, JobSlot, cancel_key, inflight_key
from speculation.worker.generation import Prepared, speculate
from tests.speculation.worker.conftest import local_prod_endpoint
from tests.support.models import draft_of, tiny_model
from tests.support.stats import (
    chi2_critical,
    chi2_statistic,
    exact_sequence_distribution,
    wrong_verify_sampled,
)

SAMPLING = {"temperature": 0.7, "top_k": 0, "top_p": 0.9}


def _tokens(target_model, draft_model, prompt: list[int], *, seed: int, max_tokens: int = 3) -> list[int]:
    prepared = Prepared(
        proposer=DraftModelProposer(draft_model, target_vocab_size=target_model.vocab_size),
        tokenizer=None,
        eos_ids=frozenset(),
        target=LocalTarget(target_model),
    )
    out: list[int] = []
    sampling = {**SAMPLING, "seed": seed}
    stats = speculate(prepared, prompt_ids=prompt, max_tokens=max_tokens, k=2, on_tokens=out.extend, sampling=sampling)
    assert stats.output_tokens == len(out)  # what was streamed is what the loop committed
    return out


def test_the_local_path_samples_the_targets_processed_distribution(monkeypatch):
    # given a 4-token vocabulary: the 64 three-token continuations are enumerated exactly at temperature 0.7,
    # top-p 0.9 (what the job carries)
    torch.set_num_threads(1)
    target_model = tiny_model(vocab=4, dim=16, layers=1, seed=3, std=0.6)
    draft_model = tiny_model(vocab=4, dim=16, layers=1, seed=4, std=0.9)
    from speculation.engine import SamplingParams

    exact = exact_sequence_distribution(target_model, [1, 2], 3, SamplingParams(**SAMPLING))

    def counts() -> torch.Tensor:
        found = torch.zeros(64)
        for seed in range(400):
            a, b, c = _tokens(target_model, draft_model, [1, 2], seed=seed)
            found[a * 16 + b * 4 + c] += 1
        return found

    # when / then: the worker's speculate passes the chi-square test (p < 1e-3 rejects) ...
    stat, dof = chi2_statistic(counts(), exact)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} >= {chi2_critical(dof):.1f} (dof {dof})"
    # ... which a wrong sampler (recovered token from p, not the residual) fails
    monkeypatch.setattr(step_module, "verify_sampled", wrong_verify_sampled)
    stat, dof = chi2_statistic(counts(), exact)
    assert stat >= chi2_critical(dof), f"the wrong sampler passed: chi2 {stat:.1f} (dof {dof})"


def test_the_same_seed_gives_the_same_tokens():
    target_model = tiny_model(seed=0)
    draft_model = draft_of(target_model)
    first = _tokens(target_model, draft_model, [1, 2, 3], seed=7, max_tokens=40)
    assert _tokens(target_model, draft_model, [1, 2, 3], seed=7, max_tokens=40) == first
    others = {tuple(_tokens(target_model, draft_model, [1, 2, 3], seed=s, max_tokens=40)) for s in range(8, 12)}
    assert others != {tuple(first)}  # other seeds do sample (5 runs of 40 tokens at temperature 0.7)


# --- admission and cancellation (real Redis) -------------------------------------------------------------------


def _wait_for(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_admission_takes_slots_up_to_the_declared_capacity_and_frees_them(client, redis_server):
    from speculation.gateway import admission

    node = f"t{time.monotonic_ns()}"

    async def admit(request_id: str):
        return await admission.admit(node_class=node, request_id=request_id, hold_s=60)

    async def scenario():
        # given no worker has declared capacity: the request is let through (the start timeout decides)
        undeclared = await admit("r0")
        # when a worker declares 2 prod slots
        heartbeat = CapacityHeartbeat(redis_url=redis_server.url, node_classes=[node], member="w1", concurrency=2)
        heartbeat.start()
        await asyncio.to_thread(_wait_for, lambda: client.zcard(f"ace:workers:{node}") == 1)
        client.delete(inflight_key(node))
        taken = [await admit(f"r{i}") for i in (1, 2, 3)]
        JobSlot(client, request_id="r1", node_class=node, hold_s=60).release()  # r1 finished
        after_release = await admit("r4")
        heartbeat.stop()
        return undeclared, taken, after_release

    undeclared, taken, after_release = asyncio.run(scenario())
    assert undeclared.admitted and not undeclared.declared
    assert [a.admitted for a in taken] == [True, True, False]
    assert taken[2].reason(node) == f"worker at capacity: 2 of 2 prod slots on gpu.{node} in use"
    assert after_release.admitted
    assert client.zcard(f"ace:workers:{node}") == 0  # a stopped worker withdraws its capacity


def test_a_cancel_from_the_gateway_frees_the_slot_and_stops_the_job(client):
    from speculation.gateway import admission

    node = f"t{time.monotonic_ns()}"
    client.zadd(inflight_key(node), {"job": time.time() + 60})
    slot = JobSlot(client, request_id="job", node_class=node, hold_s=60)
    slot.check()  # not cancelled: nothing raised
    asyncio.run(admission.cancel_now(node_class=node, request_id="job"))
    assert client.zscore(inflight_key(node), "job") is None
    with pytest.raises(Cancelled):
        slot.check()


@pytest.fixture
def local_job(db, redis_server, client, tiny_model_dir):
    """A prod job on the local path of an endpoint whose target and draft are the tiny model."""
    endpoint, _ = local_prod_endpoint(client, name="tiny", target_dir=tiny_model_dir, draft_dir=tiny_model_dir)
    request_id = f"cancel-{time.monotonic_ns()}"
    client.zadd(inflight_key("cpu"), {request_id: time.time() + 60})
    return {
        "request_id": request_id,
        "endpoint_id": endpoint.pk,
        "prompt_ids": [1, 5, 6, 7],
        "max_tokens": 200,
        "k": 3,
        "path": "local",
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 1},
        "stop": {"ignore_eos": True},
        "node_class": "cpu",
    }


def _messages(client, request_id: str) -> list[dict]:
    from speculation.jobs.channel import key

    return [json.loads(m) for m in client.lrange(key(request_id), 0, -1)]


def test_a_client_that_goes_away_stops_the_worker_within_one_step(local_job, client, monkeypatch):
    from speculation.jobs.channel import WorkerChannel
    from speculation.worker.generation import run_prod_generation

    # given: the gateway cancels right after the worker sent its second step (the client went away)
    send = WorkerChannel.send
    sent_steps = []

    def send_then_cancel(self, message, **kwargs):
        send(self, message, **kwargs)
        if message.type == "tokens":
            sent_steps.append(message)
            if len(sent_steps) == 2:
                client.set(cancel_key(local_job["request_id"]), 1)

    monkeypatch.setattr(WorkerChannel, "send", send_then_cancel)
    # when
    run_prod_generation(local_job)
    # then: one more step at most (its round trip reads the cancel), a cancelled message, the slot is free
    messages = _messages(client, local_job["request_id"])
    steps = [m for m in messages if m["type"] == "tokens"]
    assert len(steps) == 3
    assert messages[-1] == {"type": "cancelled", "tokens": sum(len(m["ids"]) for m in steps)}
    assert messages[-1]["tokens"] < local_job["max_tokens"]
    assert client.zscore(inflight_key("cpu"), local_job["request_id"]) is None


def test_a_job_cancelled_before_it_starts_never_runs(local_job, client):
    from speculation.worker.generation import run_prod_generation

    client.set(cancel_key(local_job["request_id"]), 1)  # the gateway stopped waiting for it
    run_prod_generation(local_job)
    assert _messages(client, local_job["request_id"]) == [{"type": "cancelled", "tokens": 0}]
    assert client.zscore(inflight_key("cpu"), local_job["request_id"]) is None
