"""The goodput guard: prod goes plain at a load where speculation measured slower than plain serving.

The rule is tested on its own (deterministic: the explore turn is a counter, not a coin), then through Redis with
the guard's own bookkeeping (samples kept per endpoint and load bucket, in-flight counting).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from speculation.gateway import goodput
from speculation.gateway.goodput import EXPLORE_EVERY, MIN_SAMPLES, bucket_of, choose

SLOW, FAST = [10.0] * MIN_SAMPLES, [50.0] * MIN_SAMPLES


def test_load_buckets():
    assert [bucket_of(n) for n in (1, 2, 4, 5, 16, 17, 300)] == ["1", "2-4", "2-4", "5-16", "5-16", "17+", "17+"]


def test_speculation_measured_slower_goes_plain_except_the_explore_turn():
    decisions = [choose(spec=SLOW, plain=FAST, turn=t) for t in range(EXPLORE_EVERY)]

    assert [d.plain for d in decisions] == [True] * (EXPLORE_EVERY - 1) + [False]
    assert "slower than plain" in decisions[0].reason and "10.0 vs 50.0" in decisions[0].reason


def test_speculation_measured_faster_or_unmeasured_speculates():
    assert not any(choose(spec=FAST, plain=SLOW, turn=t).plain for t in range(2 * EXPLORE_EVERY))
    # too few speculative samples: no verdict yet, whatever plain measured
    assert not any(choose(spec=SLOW[:-1], plain=FAST, turn=t).plain for t in range(2 * EXPLORE_EVERY))


def test_plain_unmeasured_at_this_load_is_measured_every_other_request():
    decisions = [choose(spec=SLOW, plain=[], turn=t) for t in range(2 * EXPLORE_EVERY)]

    assert [d.plain for d in decisions] == [False, True] * EXPLORE_EVERY
    assert all("measuring plain speed" in d.reason for d in decisions if d.plain)


def _call(endpoint_id: int, request_id: str) -> SimpleNamespace:
    return SimpleNamespace(route=SimpleNamespace(endpoint_id=endpoint_id), request_id=request_id, load_bucket="")


@pytest.fixture
def guard_on(settings, redis_server):
    settings.GOODPUT_GUARD = True
    settings.REDIS_URL = redis_server.url
    goodput._in_flight.clear()
    goodput._turns.clear()


def test_samples_kept_per_bucket_turn_the_guard_on_at_that_load_only(guard_on):
    async def run():
        # given: at one request in flight, speculation served 10 tok/s and plain 50 tok/s (8 requests each)
        for i in range(MIN_SAMPLES):
            for kind, tok_s in ((goodput.SPEC, 10.0), (goodput.PLAIN, 50.0)):
                call = _call(9001, f"r{kind}{i}")
                goodput.begin(call)
                await goodput.observe(call, kind=kind, tokens=int(tok_s), latency_ms=1000.0)
        # when: the next request arrives alone
        alone = await goodput.decide(_call(9001, "next"))
        goodput.end(_call(9001, "next"))
        # and: a request arrives while another one is in flight (bucket 2-4: nothing measured there)
        goodput.begin(_call(9001, "other"))
        second = _call(9001, "second")
        busier = await goodput.decide(second)
        return alone, busier, second.load_bucket

    alone, busier, bucket = asyncio.run(run())

    assert alone.plain and "10.0 vs 50.0" in alone.reason
    assert not busier.plain and bucket == "2-4"


def test_the_guard_off_always_speculates(settings, redis_server):
    settings.GOODPUT_GUARD = False
    decision = asyncio.run(goodput.decide(_call(9002, "x")))
    assert not decision.plain
