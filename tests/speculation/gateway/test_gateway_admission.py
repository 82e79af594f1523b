"""Admission control through real Redis: single-stream jobs (the remote path, EAGLE heads) have their own count
where the workers declare one, so a queue of them never takes the batch's slots."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis

from speculation.gateway import admission
from speculation.jobs.admission import CapacityHeartbeat, JobSlot, inflight_key, single_inflight_key


@pytest.fixture
def client(redis_server, settings):
    settings.REDIS_URL = redis_server.url
    r = redis.Redis.from_url(redis_server.url)
    yield r
    r.close()


def _wait_for(check, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_which_jobs_run_alone():
    assert admission.single_stream(path="remote", mechanism="draft_model")
    assert admission.single_stream(path="local", mechanism="eagle_head")
    assert not admission.single_stream(path="local", mechanism="draft_model")
    assert not admission.single_stream(path="local", mechanism="ngram")
    assert not admission.single_stream(path="local", mechanism="suffix")
    assert not admission.single_stream(path="local", mechanism="suffix_draft")  # the batch serves the hybrid too


def test_single_stream_jobs_are_counted_apart_and_leave_the_batch_slots_free(client, redis_server):
    node = f"s{time.monotonic_ns()}"

    async def admit(request_id: str, single: bool):
        return await admission.admit(node_class=node, request_id=request_id, hold_s=60, single=single)

    async def scenario():
        # given: a batching worker with 2 batch slots and 1 process (1 single-stream job at a time)
        heartbeat = CapacityHeartbeat(
            redis_url=redis_server.url, node_classes=[node], member="w1", concurrency=2, single=1
        )
        heartbeat.start()
        await asyncio.to_thread(_wait_for, lambda: client.zcard(f"ace:workers:{node}:single") == 1)
        # when: two remote-path jobs arrive, then two batch jobs
        remote = [await admit(f"remote{i}", True) for i in (1, 2)]
        batch = [await admit(f"batch{i}", False) for i in (1, 2)]
        # and: the first remote job refreshes its slot and ends
        slot = JobSlot(client, request_id="remote1", node_class=node, hold_s=600)
        slot.check()
        refreshed = client.zscore(single_inflight_key(node), "remote1")
        slot.release()
        again = await admit("remote3", True)
        heartbeat.stop()
        return remote, batch, refreshed, again

    remote, batch, refreshed, again = asyncio.run(scenario())

    assert [a.admitted for a in remote] == [True, False]
    assert remote[1].reason(node) == (
        f"worker at capacity: 1 of 1 single-stream prod slots (remote path, EAGLE) on gpu.{node} in use"
    )
    assert [a.admitted for a in batch] == [True, True]  # the queued remote job took no batch slot
    assert client.zscore(inflight_key(node), "remote1") is None
    assert refreshed is not None and refreshed > time.time() + 300  # the step pushed its deadline forward
    assert again.admitted
    assert client.zcard(f"ace:workers:{node}:single") == 0  # a stopped worker withdraws it


def test_without_a_declared_single_stream_count_they_share_the_batch_slots(client, redis_server):
    node = f"n{time.monotonic_ns()}"

    async def scenario():
        # a worker that does not batch declares its processes only
        heartbeat = CapacityHeartbeat(redis_url=redis_server.url, node_classes=[node], member="w1", concurrency=1)
        heartbeat.start()
        await asyncio.to_thread(_wait_for, lambda: client.zcard(f"ace:workers:{node}") == 1)
        first = await admission.admit(node_class=node, request_id="a", hold_s=60, single=True)
        second = await admission.admit(node_class=node, request_id="b", hold_s=60, single=False)
        await admission.cancel_now(node_class=node, request_id="a")
        third = await admission.admit(node_class=node, request_id="c", hold_s=60, single=False)
        heartbeat.stop()
        return first, second, third

    first, second, third = asyncio.run(scenario())

    assert first.admitted and not first.single
    assert not second.admitted  # the remote job holds the worker's one slot
    assert third.admitted  # freed by the cancel
