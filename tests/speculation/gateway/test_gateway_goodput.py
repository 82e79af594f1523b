"""The goodput guard: prod goes plain at a load where speculation is slower than plain serving.

The rule is tested on its own (deterministic: no coin, no clock), then through Redis with
the guard's own bookkeeping (samples kept per endpoint, traffic kind and load bucket, in-flight counting), then
through the gateway: off and shadow requests are plain samples, and a prod request the guard sends plain is
recorded `skipped` with the reason and answered exactly as off answers it.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import pytest
from asgiref.sync import async_to_sync

from speculation.gateway import goodput
from speculation.gateway.goodput import choose
from speculation.gateway.guard import costs, rules, topology
from speculation.gateway.guard import load as guard_load
from speculation.gateway.guard import samples as store
from speculation.gateway.guard.rules import (
    EARLY_SAMPLES,
    FEW_SAMPLES,
    GREEDY,
    LEARNERS_IN_FLIGHT,
    MIN_SAMPLES,
    PLAIN,
    SAMPLED,
    SPEC,
    bucket_of,
    traffic_of,
)

SLOW, FAST = [10.0] * MIN_SAMPLES, [50.0] * MIN_SAMPLES


def measured(**lists: list[float]) -> dict[tuple[str, str, str], list[float]]:
    """Samples named traffic__bucket__kind, e.g. greedy__1__spec (bucket 2-4 written 2_4, 17+ written 17)."""
    names = {"2_4": "2-4", "5_16": "5-16", "17": "17+"}
    out = {}
    for name, values in lists.items():
        traffic, bucket, kind = name.split("__")
        out[(traffic, names.get(bucket, bucket), kind)] = values
    return out


def test_load_buckets_and_traffic_kinds():
    assert [bucket_of(n) for n in (1, 2, 4, 5, 16, 17, 300)] == ["1", "2-4", "2-4", "5-16", "5-16", "17+", "17+"]
    bodies = [{"temperature": 0}, {"temperature": 0.0, "top_p": 0.5}, {"temperature": 0.7}, {}, {"temperature": "x"}]
    assert [traffic_of(b) for b in bodies] == [GREEDY, GREEDY, SAMPLED, SAMPLED, SAMPLED]


def test_speculation_measured_slower_goes_plain_every_time_with_no_exploration():
    samples = measured(greedy__1__spec=SLOW, greedy__1__plain=FAST)
    decisions = [choose(samples, traffic=GREEDY, bucket="1", turn=t) for t in range(50)]

    assert all(d.plain for d in decisions)
    assert "slower than plain" in decisions[0].reason and "10.0 vs 50.0" in decisions[0].reason


def test_speculation_measured_faster_speculates_and_says_why():
    samples = measured(greedy__1__spec=FAST, greedy__1__plain=SLOW)
    decisions = [choose(samples, traffic=GREEDY, bucket="1", turn=t, learning=5) for t in range(20)]
    assert not any(d.plain for d in decisions)
    assert decisions[0].reason == "goodput guard: speculation measured faster at load 1" and not decisions[0].probe


def test_above_one_request_in_flight_a_faster_load_speculates_as_many_at_once_as_it_was_measured_with(settings):
    # given: speculation measured faster at 5-16 (with one learner among plain requests)
    samples = measured(greedy__5_16__spec=FAST, greedy__5_16__plain=SLOW, greedy__1__spec=FAST, greedy__1__plain=SLOW)
    # then: one speculates; with one already speculating, the next goes plain and says why
    assert not choose(samples, traffic=GREEDY, bucket="5-16", turn=0, speculating=0).plain
    capped = choose(samples, traffic=GREEDY, bucket="5-16", turn=1, speculating=1)
    assert capped.plain
    assert capped.reason == (
        "speculation measured faster at load 5-16 with at most 1 of the endpoint's requests speculating; "
        "1 already are (goodput guard)"
    )
    # a single stream is never capped (no other request to serve plain); the cap is a setting
    assert not choose(samples, traffic=GREEDY, bucket="1", turn=0, speculating=1).plain
    settings.GOODPUT_SPECULATING = 3
    assert not choose(samples, traffic=GREEDY, bucket="5-16", turn=1, speculating=2).plain
    assert choose(samples, traffic=GREEDY, bucket="5-16", turn=1, speculating=3).plain


def test_without_a_plain_baseline_it_speculates_and_measures_plain_every_other_request_once_spec_is_known():
    unknown = [choose({}, traffic=GREEDY, bucket="1", turn=t) for t in range(4)]
    spec_only = measured(greedy__1__spec=SLOW)
    decisions = [choose(spec_only, traffic=GREEDY, bucket="1", turn=t) for t in range(20)]

    assert not any(d.plain for d in unknown)
    assert [d.plain for d in decisions] == [False, True] * 10
    assert all("measuring plain speed" in d.reason for d in decisions if d.plain)


def test_the_first_few_speculated_requests_all_slower_than_plains_median_are_enough_above_one_in_flight():
    # given: plain known from off traffic; the first EARLY_SAMPLES speculated requests all below its median
    early = measured(greedy__5_16__spec=SLOW[:EARLY_SAMPLES], greedy__5_16__plain=FAST)
    # and: as many, one of which was faster than plain's median (no verdict yet)
    mixed = measured(greedy__5_16__spec=[*SLOW[: EARLY_SAMPLES - 1], 60.0], greedy__5_16__plain=FAST)
    # and: as few as FEW_SAMPLES, all below plain's slowest (a 1-in-45 chance were both equally fast)
    below_all = measured(greedy__5_16__spec=[9.0] * FEW_SAMPLES, greedy__5_16__plain=[*FAST, 10.0])
    within = measured(greedy__5_16__spec=[9.0, 11.0], greedy__5_16__plain=[*FAST, 10.0])
    one = measured(greedy__5_16__spec=[1.0] * (FEW_SAMPLES - 1), greedy__5_16__plain=FAST)

    def decide(samples) -> rules.Decision:
        return choose(samples, traffic=GREEDY, bucket="5-16", turn=0)

    assert decide(early).plain and "slower than plain" in decide(early).reason
    assert decide(below_all).plain and "slower than plain" in decide(below_all).reason
    for undecided in (mixed, within, one):  # learned on: one learner at a time
        assert not decide(undecided).plain and decide(undecided).probe


def test_alone_the_first_slow_requests_do_not_decide_only_min_samples_do():
    # the worker's first requests run while it warms up; alone they slow no neighbour
    early = measured(greedy__1__spec=SLOW[:EARLY_SAMPLES], greedy__1__plain=FAST)
    few = measured(greedy__1__spec=[9.0] * FEW_SAMPLES, greedy__1__plain=[*FAST, 10.0])
    enough = measured(greedy__1__spec=SLOW, greedy__1__plain=FAST)

    assert not choose(early, traffic=GREEDY, bucket="1", turn=0).plain
    assert not choose(few, traffic=GREEDY, bucket="1", turn=0).plain
    decided = choose(enough, traffic=GREEDY, bucket="1", turn=0)
    assert decided.plain and "slower than plain at this load" in decided.reason


def test_slower_at_a_lower_load_is_presumed_slower_at_a_higher_one_until_measured_there():
    # given: greedy speculation measured slower at load 5-16; load 17+ has plain samples only
    samples = measured(greedy__5_16__spec=SLOW, greedy__5_16__plain=FAST, greedy__17__plain=FAST)

    higher = choose(samples, traffic=GREEDY, bucket="17+", turn=0)
    lower = choose(samples | measured(greedy__1__plain=FAST), traffic=GREEDY, bucket="1", turn=0)
    # once 17+ has its own samples and they say faster, they decide
    own = choose(samples | measured(greedy__17__spec=[90.0] * MIN_SAMPLES), traffic=GREEDY, bucket="17+", turn=0)

    assert higher.plain and "lower load 5-16" in higher.reason
    assert not lower.plain
    assert not own.plain
    # presumed slower: never speculated, whatever the turn, even without a plain baseline at that load
    no_baseline = measured(greedy__5_16__spec=SLOW, greedy__5_16__plain=FAST)
    assert all(choose(no_baseline, traffic=GREEDY, bucket="17+", turn=t).plain for t in range(50))


def test_sampled_traffic_is_presumed_slower_where_greedy_is_but_not_the_other_way_round():
    samples = measured(
        greedy__1__spec=SLOW,
        greedy__1__plain=FAST,
        sampled__1__plain=FAST,
        sampled__2_4__spec=SLOW,
        sampled__2_4__plain=FAST,
        greedy__2_4__plain=FAST,
    )

    sampled = choose(samples, traffic=SAMPLED, bucket="1", turn=0)
    greedy_higher = choose(samples, traffic=GREEDY, bucket="2-4", turn=0)  # greedy slower at 1 already says so
    only_sampled = measured(sampled__1__spec=SLOW, sampled__1__plain=FAST, greedy__1__plain=FAST)

    assert sampled.plain and "greedy speculation measured slower" in sampled.reason
    assert greedy_higher.plain and "greedy speculation measured slower than plain at the lower load 1" in (
        greedy_higher.reason
    )
    assert not choose(only_sampled, traffic=GREEDY, bucket="1", turn=0).plain


def test_goodput_weighs_each_request_by_the_seconds_it_ran_so_short_fast_ones_do_not_outvote_long_slow_ones():
    """8 streams on a machine the worker shares with the server (figures as measured on 2 cores): the learner's
    requests end in 0.6 s at 107 tok/s one after another, the plain ones beside it in 7.4 s at 8.6 tok/s; off's in
    2 s at 32 tok/s. Per stream the endpoint served 64 x 16 tokens in 9 x 0.6 + 7 x 7.4 s: 17.9 tok/s, slower than
    plain's 32, though the median request (a learner's) was faster."""
    spec = [(107.0, 0.6)] * 9 + [(8.6, 7.4)] * 7
    plain = [(32.0, 2.0)] * MIN_SAMPLES

    assert round(rules.goodput(spec), 1) == 17.9 and rules.goodput(plain) == 32.0
    assert round(rules.goodput(spec, trim=1), 1) == 19.3  # without one neighbour: still slower
    assert rules.verdict(spec, plain) == "slower"
    assert rules.verdict([(107.0, 0.6)] * 9, plain) == "faster"  # the learners alone
    assert rules.goodput([10.0, 30.0]) == 20.0  # a bare tok/s (kept before the seconds were) weighs 1 s
    assert store.parse(b"12.5:0.400") == (12.5, 0.4) and store.parse(b"12.5") == 12.5


def test_one_long_request_such_as_the_workers_cold_start_does_not_decide_alone():
    """One stream: 7 speculated requests at 150 tok/s in 0.43 s and the first one, which loaded the models, 64 tokens
    in 3.5 s; plain 75 tok/s. All eight weighted by their seconds: 95.6 tok/s, slower than plain's 100 would be; the
    verdict leaves out each side's longest request."""
    spec = [(18.3, 3.5)] + [(150.0, 0.43)] * 7
    plain = [(75.0, 0.85)] * MIN_SAMPLES

    assert rules.TRIM == 1
    assert rules.goodput(spec) < 1.3 * rules.goodput(plain)  # the cold start weighs 3.5 s of 6.5
    assert rules.goodput(spec, trim=1) == 150.0
    assert rules.verdict(spec, plain) == "faster"


def test_above_one_request_in_flight_faster_needs_the_crowded_margin_over_plains_goodput():
    plain = [(40.0, 2.0)] * MIN_SAMPLES
    a_little = [(40.0 * (1 + rules.CROWDED_MARGIN) / 2, 2.0)] * MIN_SAMPLES  # between plain and the margin
    clearly = [(40.0 * rules.CROWDED_MARGIN + 1, 2.0)] * MIN_SAMPLES
    samples = measured(greedy__1__plain=plain, greedy__1__spec=a_little, greedy__5_16__plain=plain)
    samples |= measured(greedy__5_16__spec=a_little, greedy__17__plain=plain, greedy__17__spec=clearly)

    alone = choose(samples, traffic=GREEDY, bucket="1", turn=0)
    crowded = choose(samples, traffic=GREEDY, bucket="5-16", turn=0)
    higher = choose(samples, traffic=GREEDY, bucket="17+", turn=0)

    assert rules.CROWDED_MARGIN > 1.0
    assert not alone.plain  # at one request in flight any gain counts
    assert crowded.plain and f"less than {rules.CROWDED_MARGIN}x plain's goodput" in crowded.reason
    assert not higher.plain  # its own verdict, clear of the margin


def test_a_slower_verdict_above_one_request_in_flight_holds_while_plains_newer_samples_drift(monkeypatch):
    clock = [5000.0]
    monkeypatch.setattr(guard_load, "_now", lambda: clock[0])
    guard_load._held.clear()
    spec = [(12.3, 3.0)] * MIN_SAMPLES
    before = measured(greedy__5_16__plain=[(19.0, 2.0)] * MIN_SAMPLES, greedy__1__plain=[(19.0, 2.0)] * MIN_SAMPLES)
    before |= measured(greedy__5_16__spec=spec, greedy__1__spec=spec)
    drifted = before | measured(greedy__5_16__plain=[(9.0, 4.0)] * MIN_SAMPLES, greedy__1__plain=[(9.0, 4.0)] * 8)

    try:
        assert not guard_load.hold_slower(1, before, traffic=GREEDY, bucket="5-16")  # reached now: remembered
        clock[0] += 60.0
        held = guard_load.hold_slower(1, drifted, traffic=GREEDY, bucket="5-16")
        at_one = guard_load.hold_slower(1, drifted, traffic=GREEDY, bucket="1")
        decided = choose(drifted, traffic=GREEDY, bucket="5-16", turn=0, held=held)
        clock[0] += rules.SPEC_TTL_S
        expired = guard_load.hold_slower(1, drifted, traffic=GREEDY, bucket="5-16")
        gone = guard_load.hold_slower(1, before | {(GREEDY, "5-16", SPEC): []}, traffic=GREEDY, bucket="5-16")
    finally:
        guard_load._held.clear()

    assert rules.verdict(spec, drifted[(GREEDY, "5-16", PLAIN)], bucket="5-16") == "faster"  # the drift alone
    assert held and decided.plain and "measured slower" in decided.reason
    assert not at_one  # at one request in flight the verdict follows the samples
    assert not expired and not gone


def test_no_learner_starts_while_the_requests_beside_speculation_would_complete_its_samples():
    samples = measured(greedy__5_16__plain=FAST, greedy__5_16__spec=[(80.0, 0.6)])

    waiting = choose(samples, traffic=GREEDY, bucket="5-16", turn=0, pending=MIN_SAMPLES - 1)
    short = choose(samples, traffic=GREEDY, bucket="5-16", turn=0, pending=MIN_SAMPLES - 2)
    alone = choose({}, traffic=GREEDY, bucket="5-16", turn=0, pending=0)

    assert waiting.plain and not waiting.probe
    assert f"the {MIN_SAMPLES - 1} requests in flight beside speculation finish first, 1 of its" in waiting.reason
    assert not short.plain and short.probe  # 1 kept + 6 in flight: one more learner may start
    assert not alone.plain and alone.probe


def test_a_load_without_a_verdict_is_learned_by_one_speculated_request_at_a_time():
    samples = measured(greedy__17__plain=FAST)

    first = choose(samples, traffic=GREEDY, bucket="17+", turn=0, learning=0)
    full = choose(samples, traffic=GREEDY, bucket="17+", turn=1, learning=LEARNERS_IN_FLIGHT)
    no_baseline = choose({}, traffic=GREEDY, bucket="5-16", turn=0, learning=LEARNERS_IN_FLIGHT)

    assert LEARNERS_IN_FLIGHT == 1
    assert not first.plain and first.probe and first.reason == "goodput guard: learning load 17+"
    assert full.plain and "learning load 17+" in full.reason
    assert no_baseline.plain  # nothing known at all: learned one request at a time too


def test_where_the_worker_shares_the_servers_machine_a_load_above_one_is_presumed_slower_not_learned():
    samples = measured(greedy__5_16__plain=FAST, greedy__1__plain=FAST, greedy__1__spec=[f * 2 for f in FAST])

    crowded = choose(samples, traffic=GREEDY, bucket="5-16", turn=0, shared=True)
    sampled = choose(samples, traffic=SAMPLED, bucket="2-4", turn=0, shared=True)
    alone = choose(samples, traffic=GREEDY, bucket="1", turn=0, shared=True)
    apart = choose(samples, traffic=GREEDY, bucket="5-16", turn=0, shared=False)
    # a load measured faster (learned with ACE_GOODPUT_SHARED_LEARN=true, say) keeps its verdict
    learned = choose({**samples, **measured(greedy__5_16__spec=[f * 2 for f in FAST])}, traffic=GREEDY,
                     bucket="5-16", turn=0, shared=True)  # fmt: skip

    assert crowded.plain and not crowded.probe and "shares the server's machine" in crowded.reason
    assert "not measured at load 5-16" in crowded.reason
    assert sampled.plain and "shares the server's machine" in sampled.reason
    assert not alone.plain  # one request in flight has no neighbour to take cores from: measured faster there
    assert not apart.plain and apart.probe  # a worker on its own machine learns the load as before
    assert not learned.plain and "measured faster at load 5-16" in learned.reason


def test_where_the_workers_batch_takes_the_whole_load_every_request_learns_and_speculates_together():
    samples = measured(greedy__5_16__plain=FAST)
    kwargs = dict(traffic=GREEDY, bucket="5-16", turn=0, learning=3, speculating=3, pending=7)

    learning = choose(samples, **kwargs, batched=True)
    one_learner = choose(samples, **kwargs)  # the old regime: one learner at a time
    faster = choose({**samples, **measured(greedy__5_16__spec=[f * 1.15 for f in FAST])}, **kwargs, batched=True)
    not_enough = choose({**samples, **measured(greedy__5_16__spec=[f * 1.05 for f in FAST])}, **kwargs, batched=True)
    crowded = choose({**samples, **measured(greedy__5_16__spec=[f * 1.15 for f in FAST])}, **kwargs)
    slower = choose({**samples, **measured(greedy__5_16__spec=SLOW)}, **kwargs, batched=True)

    assert not learning.plain and learning.probe and "on the worker's batch" in learning.reason  # 3 others learn too
    assert one_learner.plain and "learning load 5-16" in one_learner.reason
    assert not faster.plain and "measured faster at load 5-16 with the load on the worker's batch" in faster.reason
    assert not_enough.plain  # below BATCHED_MARGIN: the drift between the two sides' moments could make it up
    assert crowded.plain  # one learner among plain neighbours needs CROWDED_MARGIN, and then speculates one at a time
    assert slower.plain and "measured slower" in slower.reason
    assert rules.BATCHED_MARGIN < rules.CROWDED_MARGIN


def test_the_batch_takes_a_load_within_the_slots_its_live_workers_declare_on_the_local_path(guard_on):
    import time

    from speculation.jobs.admission import workers_key

    r = _redis()
    r.delete(workers_key("batching"))
    r.zadd(workers_key("batching"), {"celery@a|8": time.time() + 30, "celery@b|4": time.time() + 30})
    r.zadd(workers_key("batching"), {"celery@gone|16": time.time() - 1})  # stopped declaring

    def takes(load: int, **route) -> bool:
        topology._workers.clear()
        return asyncio.run(topology.batch_takes(_call(1, "x", node_class="batching", **route).route, load))

    assert takes(8, path="local") and takes(12, path="local", mechanism="ngram")
    assert not takes(13, path="local")  # 12 slots live
    assert not takes(8, path="remote") and not takes(8, path="local", mechanism="eagle_head")  # single-stream paths
    assert not takes(1, path="local")  # one request in flight is the old regime (it has no neighbours)
    assert not asyncio.run(topology.batch_takes(_call(1, "x", node_class="nobody", path="local").route, 2))


def test_at_8_streams_on_a_batching_worker_the_load_is_learned_all_together_unless_it_shares_the_machine(guard_on):
    import socket
    import time

    from speculation.jobs.admission import workers_key

    r = _redis()
    here = socket.gethostname()
    r.delete(workers_key("batch-gpu"), workers_key("batch-here"))
    r.zadd(workers_key("batch-gpu"), {"celery@gpu-7.example.com|8": time.time() + 30})
    r.zadd(workers_key("batch-here"), {f"celery@{here}|8": time.time() + 30})

    def streams(n: int, node_class: str, base_url: str) -> list[rules.Decision]:
        for state in (guard_load._in_flight, guard_load._load, topology._shared, topology._workers, guard_load._turns):
            state.clear()

        async def run() -> list[rules.Decision]:
            await _keep_at(9030, n, PLAIN, 40.0, n=MIN_SAMPLES)
            calls = [_call(9030, f"s{n}-{i}", base_url=base_url, node_class=node_class, path="local") for i in range(n)]
            for call in calls:
                goodput.begin(call)
            return [await goodput.decide(call) for call in calls]

        return asyncio.run(run())

    eight = streams(8, "batch-gpu", "http://10.255.0.1:8000")
    assert all(not d.plain and d.probe and "on the worker's batch" in d.reason for d in eight)
    twelve = streams(12, "batch-gpu", "http://10.255.0.1:8000")  # more than the 8 slots: one learner at a time
    assert sum(not d.plain for d in twelve) == 1 and "learning load 5-16" in twelve[1].reason
    shared = streams(8, "batch-here", "http://127.0.0.1:8000")  # the worker shares the server's machine
    assert all(d.plain and "shares the server's machine" in d.reason for d in shared)


def test_a_server_on_this_machine_is_one_at_a_loopback_address_or_this_hosts_name():
    import socket

    from speculation.gateway.guard.topology import server_on_this_machine, worker_machines

    assert all(
        server_on_this_machine(url)
        for url in (
            "http://127.0.0.1:8000",
            "http://localhost:8000/v1",
            "http://[::1]:9/",
            f"http://{socket.gethostname()}:1",
        )
    )
    assert not any(server_on_this_machine(url) for url in ("http://10.255.0.1:8000", "https://gpu-7.example.com"))
    members = [b"celery@gpu-7|4", "worker1@Node-B.local|2", "plain-name|1"]
    assert worker_machines(members) == {"gpu-7", "node-b.local", "plain-name"}


def test_the_guard_finds_a_worker_on_the_servers_machine_from_the_workers_declared_capacity(guard_on, settings):
    import socket
    import time

    from speculation.jobs.admission import workers_key

    r = _redis()
    here = socket.gethostname()
    r.delete(workers_key("shared-here"), workers_key("elsewhere"), workers_key("expired"))
    r.zadd(workers_key("shared-here"), {f"celery@{here}|4": time.time() + 30})
    r.zadd(workers_key("elsewhere"), {"celery@gpu-7.example.com|4": time.time() + 30})
    r.zadd(workers_key("expired"), {f"celery@{here}|4": time.time() - 1})  # a worker that stopped declaring

    def shares(node_class: str, base_url: str = "http://127.0.0.1:8000") -> bool:
        topology._shared.clear()
        return asyncio.run(topology.shares_machine(_call(1, "x", base_url=base_url, node_class=node_class).route))

    async def at_8_streams() -> rules.Decision:
        await _keep_at(9020, 8, PLAIN, 40.0, n=MIN_SAMPLES)
        for i in range(7):
            goodput.begin(_call(9020, f"n{i}", base_url="http://127.0.0.1:8000", node_class="shared-here"))
        return await goodput.decide(_call(9020, "eighth", base_url="http://127.0.0.1:8000", node_class="shared-here"))

    assert shares("shared-here")
    assert not shares("shared-here", base_url="http://10.255.0.1:8000")  # the server is on another machine
    assert not shares("elsewhere") and not shares("expired") and not shares("nobody")
    topology._shared.clear()
    decision = asyncio.run(at_8_streams())
    assert decision.plain and not decision.probe and "shares the server's machine" in decision.reason
    settings.GOODPUT_SHARED_LEARN = True
    assert not shares("shared-here")


def _call(
    endpoint_id: int,
    request_id: str,
    *,
    temperature: float = 0.0,
    base_url: str = "http://gpu-node.invalid:8000",
    node_class: str = "cpu",
    path: str = "remote",
    mechanism: str = "draft_model",
) -> SimpleNamespace:
    route = SimpleNamespace(
        endpoint_id=endpoint_id, mode="prod", base_url=base_url, node_class=node_class, path=path, mechanism=mechanism
    )
    return SimpleNamespace(
        route=route,
        request_id=request_id,
        body={"temperature": temperature},
        load_bucket="",
        traffic="",
        kind="completion",
    )


@pytest.fixture
def guard_on(settings, redis_server):
    settings.GOODPUT_GUARD = True
    settings.REDIS_URL = redis_server.url
    states = (guard_load._in_flight, guard_load._turns, guard_load._load, guard_load._held, topology._shared)
    for state in (*states, topology._workers, store._read_cache, costs._models):
        state.clear()
    yield
    for state in (*states, topology._workers, store._read_cache, costs._models):
        state.clear()


async def _keep(endpoint_id: int, kind: str, tok_s: float, *, n: int, temperature: float = 0.0) -> None:
    for i in range(n):
        call = _call(endpoint_id, f"{kind}{temperature}{tok_s}{i}", temperature=temperature)
        goodput.begin(call)
        await goodput.observe(call, kind=kind, tokens=10, latency_ms=10_000.0 / tok_s)


def test_samples_kept_per_bucket_and_traffic_turn_the_guard_on_there_only(guard_on):
    async def run():
        # given: at one request in flight, greedy speculation served 10 tok/s and plain 50 tok/s
        await _keep(9001, SPEC, 10.0, n=MIN_SAMPLES)
        await _keep(9001, PLAIN, 50.0, n=MIN_SAMPLES)
        # and: sampled requests, plain 50 tok/s, speculation unmeasured
        await _keep(9001, PLAIN, 50.0, n=MIN_SAMPLES, temperature=0.7)
        # when: the next greedy request arrives alone
        alone = await goodput.decide(_call(9001, "next"))
        goodput.end(_call(9001, "next"))
        # and: a sampled request arrives alone (presumed slower: greedy is slower at this load)
        sampled = await goodput.decide(_call(9001, "sampled", temperature=0.7))
        goodput.end(_call(9001, "sampled"))
        # and: a greedy request arrives while another one is in flight (bucket 2-4: nothing measured there, so
        # presumed slower from load 1)
        goodput.begin(_call(9001, "other"))
        second = _call(9001, "second")
        busier = await goodput.decide(second)
        return alone, sampled, busier, second.load_bucket

    alone, sampled, busier, bucket = asyncio.run(run())

    assert alone.plain and "10.0 vs 50.0" in alone.reason
    assert sampled.plain and "greedy speculation measured slower than plain at load 1" in sampled.reason
    assert busier.plain and bucket == "2-4" and "lower load 1; not measured at load 2-4" in busier.reason


def test_a_sample_is_kept_at_the_mean_load_it_ran_under(guard_on, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(guard_load, "_now", lambda: clock[0])

    async def run():
        # given: a request starts alone (decided at load 1), then 7 more join it at once and all run for 9 s
        first = _call(9003, "first")
        goodput.begin(first)
        clock[0] += 1.0
        others = [_call(9003, f"o{i}") for i in range(7)]
        for call in others:
            goodput.begin(call)
        clock[0] += 9.0
        # when: the first ends (mean load (1 x 1 s + 8 x 9 s) / 10 s = 7.3), then the others (8 each)
        await goodput.observe(first, kind=PLAIN, tokens=10, latency_ms=10_000.0)
        for call in others:
            await goodput.observe(call, kind=PLAIN, tokens=10, latency_ms=9_000.0)
        return first.load_bucket

    decided_at = asyncio.run(run())

    assert decided_at == "1"
    assert _samples(9003, GREEDY, "1", PLAIN) == []
    assert len(_samples(9003, GREEDY, "5-16", PLAIN)) == 8
    assert guard_load._in_flight[9003] == {}


def test_a_request_is_decided_at_the_peak_load_of_the_last_seconds(guard_on, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(guard_load, "_now", lambda: clock[0])
    burst = [_call(9004, f"b{i}") for i in range(8)]
    for call in burst:
        goodput.begin(call)
    for call in burst:
        goodput.end(call)
    # the next request starts alone 1 s later: decided at the burst's load; alone again after RECENT_S
    clock[0] += 1.0
    soon = _call(9004, "soon")
    goodput.begin(soon)
    goodput.end(soon)
    clock[0] += goodput.RECENT_S + 1.0
    later = _call(9004, "later")
    goodput.begin(later)

    assert [c.load_bucket for c in burst] == ["1", "2-4", "2-4", "2-4", "5-16", "5-16", "5-16", "5-16"]
    assert soon.load_bucket == "5-16" and later.load_bucket == "1"


async def _decide_at(endpoint_id: int, load: int, name: str, *, temperature: float = 0.0) -> rules.Decision:
    """Decide a request that arrives with load - 1 others of the endpoint in flight (they stay in flight)."""
    for i in range(load - 1 - len(guard_load._in_flight[endpoint_id])):
        goodput.begin(_call(endpoint_id, f"{name}-other{i}"))
    return await goodput.decide(_call(endpoint_id, name, temperature=temperature))


def _quiet(endpoint_id: int) -> None:
    """The endpoint's requests all ended long ago (no peak load remembered)."""
    guard_load._in_flight[endpoint_id].clear()
    guard_load._load.pop(endpoint_id, None)


def _redis():
    import redis
    from django.conf import settings

    return redis.Redis.from_url(settings.REDIS_URL)


def _spec_key(endpoint_id: int, bucket: str) -> str:
    return goodput.KEY.format(endpoint_id=endpoint_id, traffic=GREEDY, bucket=bucket, kind=SPEC)


async def _keep_at(endpoint_id: int, load: int, kind: str, tok_s: float, *, n: int) -> None:
    """n samples kept at a mean load of `load` (the others in flight the whole time)."""
    others = [_call(endpoint_id, f"bg{kind}{tok_s}{j}") for j in range(load - 1)]
    for call in others:
        goodput.begin(call)
    await _keep(endpoint_id, kind, tok_s, n=n)
    for call in others:
        goodput.end(call)


def test_after_a_slower_verdict_at_8_streams_requests_at_32_go_plain_with_no_exploration(guard_on):
    async def run():
        # given: plain measured at 8 and 32 streams (off traffic), speculation slower at 8
        await _keep_at(9010, 8, PLAIN, 50.0, n=MIN_SAMPLES)
        await _keep_at(9010, 32, PLAIN, 40.0, n=MIN_SAMPLES)
        await _keep_at(9010, 8, SPEC, 10.0, n=EARLY_SAMPLES)
        # when: 60 greedy requests arrive at 32 in flight, and 60 sampled ones
        greedy = [await _decide_at(9010, 32, f"g{i}") for i in range(60)]
        sampled = [await _decide_at(9010, 32, f"s{i}", temperature=0.7) for i in range(60)]
        return greedy, sampled

    greedy, sampled = asyncio.run(run())

    # then: every one plain, none explores or learns, each with the evidence
    assert all(d.plain and not d.probe for d in greedy + sampled)
    assert "measured slower than plain at the lower load 5-16; not measured at load 17+" in greedy[0].reason
    assert "greedy speculation measured slower than plain at load 5-16" in sampled[0].reason


def test_speculative_samples_expire_from_their_first_one_and_the_low_load_is_learned_again_first(guard_on):
    r = _redis()

    async def run():
        # given: speculation measured slower at 8 streams, then at 32 (samples from before this rule)
        await _keep_at(9011, 8, PLAIN, 50.0, n=MIN_SAMPLES)
        await _keep_at(9011, 32, PLAIN, 40.0, n=MIN_SAMPLES)
        await _keep_at(9011, 8, SPEC, 10.0, n=FEW_SAMPLES)
        await _keep_at(9011, 32, SPEC, 8.0, n=FEW_SAMPLES)
        # the TTL runs from a list's first sample: a later sample does not extend it (as Redis counts it down)
        r.expire(_spec_key(9011, "5-16"), 100)
        await _keep_at(9011, 8, SPEC, 10.0, n=1)
        ttl_after_a_later_sample = r.ttl(_spec_key(9011, "5-16"))
        # when: the 8-stream verdict expires first (it was measured first)
        r.delete(_spec_key(9011, "5-16"))
        store.forget()  # a process sees an expired list within READ_TTL_S: here at once
        at_32 = await _decide_at(9011, 32, "high")
        _quiet(9011)
        at_8 = await _decide_at(9011, 8, "low")
        # and: 8 streams is learned slower again, then the 32-stream verdict expires
        _quiet(9011)
        await _keep_at(9011, 8, SPEC, 10.0, n=FEW_SAMPLES)
        r.delete(_spec_key(9011, "17+"))
        store.forget()
        again_32 = [await _decide_at(9011, 32, f"again{i}") for i in range(20)]
        return ttl_after_a_later_sample, at_32, at_8, again_32

    ttl, at_32, at_8, again_32 = asyncio.run(run())

    assert 0 < ttl <= 100
    assert 0 < r.ttl(_spec_key(9011, "5-16")) <= rules.SPEC_TTL_S
    plain_key = goodput.KEY.format(endpoint_id=9011, traffic=GREEDY, bucket="5-16", kind=PLAIN)
    assert rules.SPEC_TTL_S < r.ttl(plain_key) <= store.EXPIRE_S  # plain samples live on
    # 32 streams keeps its own verdict while 8 streams, without one, is learned again
    assert at_32.plain and "measured slower than plain at this load" in at_32.reason
    assert not at_8.plain and at_8.probe and at_8.reason == "goodput guard: learning load 5-16"
    # 32 streams is not learned while the lower load's fresh verdict presumes it slower
    assert all(d.plain and not d.probe for d in again_32)
    assert "lower load 5-16" in again_32[0].reason


def test_the_samples_are_read_from_redis_once_per_read_ttl_and_this_processs_own_are_seen_at_once(
    guard_on, monkeypatch
):
    monkeypatch.setattr(store, "READ_TTL_S", 0.3)

    def lranges() -> int:
        return int(_redis().info("commandstats").get("cmdstat_lrange", {}).get("calls", 0))

    async def run():
        # given: plain measured at load 1, speculation not yet
        await _keep(9013, PLAIN, 50.0, n=MIN_SAMPLES)
        first = await goodput.decide(_call(9013, "first"))
        goodput.end(_call(9013, "first"))
        # when: this process keeps speculation's samples (slower), and decides at once
        await _keep(9013, SPEC, 10.0, n=MIN_SAMPLES)
        own = await goodput.decide(_call(9013, "own"))
        goodput.end(_call(9013, "own"))
        # and: another process's samples land in Redis (speculation now faster there)
        key = _spec_key(9013, "1")
        _redis().delete(key)
        _redis().lpush(key, *[f"{90.0:.3f}:{1.0:.3f}"] * MIN_SAMPLES)
        before_ttl = await goodput.decide(_call(9013, "before"))
        goodput.end(_call(9013, "before"))
        await asyncio.sleep(0.35)
        after_ttl = await goodput.decide(_call(9013, "after"))
        goodput.end(_call(9013, "after"))
        return first, own, before_ttl, after_ttl

    read_before = lranges()
    first, own, before_ttl, after_ttl = asyncio.run(run())

    # then: the first request learns; this process's slower samples decide the next one at once
    assert not first.plain and first.probe
    assert own.plain and "10.0 vs 50.0" in own.reason
    # another process's samples are not read again within READ_TTL_S, and are after it
    assert before_ttl.plain and "10.0 vs 50.0" in before_ttl.reason
    assert not after_ttl.plain and "measured faster" in after_ttl.reason
    # and: the 16 lists were read twice in all (once per READ_TTL_S) for the four decisions
    assert lranges() - read_before == 2 * len(store.NAMES)


def test_plain_samples_kept_within_flush_s_are_written_together_and_seen_here_at_once(guard_on):
    from speculation.gateway import background

    key = goodput.KEY.format(endpoint_id=9031, traffic=GREEDY, bucket="1", kind=PLAIN)

    async def run():
        # given: this process has read the endpoint's samples (none yet)
        await store.read(9031)
        # when: five off requests keep their plain samples one after another
        for _ in range(5):
            store.keep_later(9031, (GREEDY, "1", PLAIN), tokens=10, seconds=0.5)
        loop = asyncio.get_running_loop()
        writers = [task for task in background._pending if task.get_loop() is loop]
        seen_here = len((await store.read(9031))[(GREEDY, "1", PLAIN)])
        in_redis_before = _redis().llen(key)
        await asyncio.gather(*writers)
        return len(writers), seen_here, in_redis_before

    writers, seen_here, in_redis_before = asyncio.run(run())

    # then: one write for the five, after FLUSH_S; this process counted them at once
    assert writers == 1
    assert seen_here == 5
    assert in_redis_before == 0
    assert [store.parse(v) for v in _redis().lrange(key, 0, -1)] == [(20.0, 0.5)] * 5


def test_at_most_one_speculated_request_learns_at_a_time(guard_on):
    async def run():
        # given: plain measured at 32 streams only; nothing speculated yet
        await _keep_at(9012, 32, PLAIN, 40.0, n=MIN_SAMPLES)
        learner = _call(9012, "learner")
        for i in range(31):
            goodput.begin(_call(9012, f"other{i}"))
        first = await goodput.decide(learner)
        # when: more requests arrive while the learner is in flight
        while_learning = [await goodput.decide(_call(9012, f"next{i}")) for i in range(10)]
        # and: the learner ends (its sample kept), then another request arrives
        await goodput.observe(learner, kind=SPEC, tokens=10, latency_ms=500.0)
        after = await goodput.decide(_call(9012, "after"))
        # and: the requests that ran beside the learner end too (no sample kept), then another arrives
        for request_id, flight in list(guard_load._in_flight[9012].items()):
            if flight.beside:
                goodput.end(_call(9012, request_id))
        drained = await goodput.decide(_call(9012, "drained"))
        return first, while_learning, after, drained

    first, while_learning, after, drained = asyncio.run(run())

    assert not first.plain and first.probe
    assert all(d.plain for d in while_learning)
    assert "a speculated request in flight measures it first" in while_learning[0].reason
    # the 41 requests beside the learner will be speculation's samples: no second learner until they are in
    assert after.plain and "the 41 requests in flight beside speculation finish first" in after.reason
    assert not drained.plain and drained.probe


def test_plain_requests_served_beside_a_speculating_one_are_speculations_samples(guard_on, monkeypatch):
    """On a machine the worker shares with the server a speculating request slows its plain neighbours: their tok/s
    is part of what speculating at that load gives, so it is kept with speculation's samples, not plain's."""
    clock = [1000.0]
    monkeypatch.setattr(guard_load, "_now", lambda: clock[0])

    async def run():
        # given: plain measured at 5-16 streams (off traffic, nothing speculating), nothing speculated yet
        await _keep_at(9014, 8, PLAIN, 50.0, n=MIN_SAMPLES)
        before = [_call(9014, f"before{i}") for i in range(6)]  # in flight when the learner starts
        for call in before:
            goodput.begin(call)
        learner = _call(9014, "learner")
        first = await goodput.decide(learner)
        after = _call(9014, "after")  # arrives while the learner speculates: sent plain
        went = await goodput.decide(after)
        # when: all of them finish 10 s later (8 in flight throughout), the plain ones at 20 tok/s, the learner at 60
        clock[0] += 10.0
        await goodput.observe(learner, kind=SPEC, tokens=10, latency_ms=10_000.0 / 60.0)
        for call in [*before, after]:
            await goodput.observe(call, kind=PLAIN, tokens=10, latency_ms=10_000.0 / 20.0)
        # and: a plain request with nothing speculating beside it
        alone = _call(9014, "alone")
        goodput.begin(alone)
        clock[0] += 10.0
        await goodput.observe(alone, kind=PLAIN, tokens=10, latency_ms=10_000.0 / 45.0)
        return first, went

    first, went = asyncio.run(run())

    assert not first.plain and first.probe and went.plain
    spec, plain = _samples(9014, GREEDY, "5-16", SPEC), _samples(9014, GREEDY, "5-16", PLAIN)
    assert sorted(spec) == [20.0] * 7 + [60.0]  # the learner and the seven beside it
    assert len(plain) == MIN_SAMPLES and 45.0 in _samples(9014, GREEDY, "1", PLAIN)
    # then: the next request at that load goes plain: with its neighbours, speculation served less than plain
    decided = asyncio.run(_decide_at(9014, 8, "next"))
    # (goodput without each side's longest request: 6 x 10 tokens in 0.5 s and the learner's 10 in 0.17 s: 70 in 3.17 s)
    assert decided.plain and "measured slower" in decided.reason and "22.1 vs 50.0" in decided.reason


def test_a_request_is_decided_at_the_load_that_arrived_while_the_guard_read_its_samples(guard_on, monkeypatch):
    # given: speculation faster alone, slower at 8 streams
    asyncio.run(_keep_at(9013, 1, SPEC, 90.0, n=MIN_SAMPLES))
    asyncio.run(_keep_at(9013, 1, PLAIN, 50.0, n=MIN_SAMPLES))
    asyncio.run(_keep_at(9013, 8, SPEC, 10.0, n=EARLY_SAMPLES))
    asyncio.run(_keep_at(9013, 8, PLAIN, 50.0, n=MIN_SAMPLES))
    read = store.read

    async def burst_arrives_during_the_read(endpoint_id: int, pairing: str = ""):
        for i in range(7):  # the rest of a burst of 8 begins while the first request awaits Redis
            goodput.begin(_call(endpoint_id, f"burst{i}"))
        return await read(endpoint_id, pairing)

    monkeypatch.setattr(store, "read", burst_arrives_during_the_read)
    first = _call(9013, "first")
    decision = asyncio.run(goodput.decide(first))

    assert first.load_bucket == "5-16"
    assert decision.plain and "slower than plain at this load" in decision.reason


def test_a_request_decided_alone_is_decided_again_when_a_burst_arrives_before_it_reaches_the_worker(guard_on):
    async def run():
        # given: speculation faster alone, slower at 8 streams
        await _keep_at(9014, 1, SPEC, 90.0, n=MIN_SAMPLES)
        await _keep_at(9014, 1, PLAIN, 50.0, n=MIN_SAMPLES)
        await _keep_at(9014, 8, SPEC, 10.0, n=EARLY_SAMPLES)
        await _keep_at(9014, 8, PLAIN, 50.0, n=MIN_SAMPLES)
        _quiet(9014)
        first, alone = _call(9014, "first"), _call(9014, "alone")
        # when: a request is decided alone and nothing arrives before it reaches the worker
        kept = goodput.reconsider(alone, await goodput.decide(alone))
        goodput.end(alone)
        _quiet(9014)
        # and: a request is decided alone, then 7 more arrive while it is tokenized
        decided = await goodput.decide(first)
        for i in range(7):
            goodput.begin(_call(9014, f"burst{i}"))
        again = goodput.reconsider(first, decided)
        return kept, decided, again, first

    kept, decided, again, first = asyncio.run(run())

    assert not kept.plain and kept.reason == "goodput guard: speculation measured faster at load 1"
    assert not decided.plain
    assert again.plain and first.load_bucket == "5-16"
    assert "slower than plain at this load" in again.reason and "the load rose to 5-16" in again.reason
    assert guard_load._in_flight[9014]["first"].probe is None  # not counted as a learner


def test_the_guard_off_always_speculates(settings, redis_server):
    settings.GOODPUT_GUARD = False
    decision = asyncio.run(goodput.decide(_call(9002, "x")))
    assert not decision.plain


# Through the gateway (ace.asgi.application over httpx's ASGI transport, real Redis, a stub server).

COMPLETION = {
    "id": "c",
    "object": "text_completion",
    "model": "stub-model",
    "choices": [{"index": 0, "text": " pass", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
}


@pytest.fixture
def gateway(guard_on, http_stub, django_user_model):
    from rest_framework.authtoken.models import Token

    from fleet.models import Endpoint, EndpointStatus
    from speculation.gateway import routes
    from speculation.models import SpeculationPolicy
    from speculation.services.version import bump_routing_version

    upstream = http_stub({("POST", "/v1/completions"): lambda request: COMPLETION})
    routes._caches.clear()
    endpoint = Endpoint.objects.create(
        name="guarded", base_url=upstream.base_url, kind="vllm", served_model="stub-model", status=EndpointStatus.READY
    )
    policy = SpeculationPolicy.objects.create(endpoint=endpoint, mode="off", path="local", shadow_sample_rate=0.0)
    admin = django_user_model.objects.create_superuser(username="guard", password="pw-for-tests-only")
    token = Token.objects.create(user=admin).key

    def set_mode(mode: str) -> None:
        policy.mode = mode
        policy.save()
        bump_routing_version()

    yield SimpleNamespace(endpoint=endpoint, token=token, set_mode=set_mode, upstream=upstream)
    routes._caches.clear()


def _post(token: str, body: dict) -> httpx.Response:
    from ace.asgi import application
    from speculation.gateway import background

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            response = await client.post(
                "/v1/completions", content=json.dumps(body).encode(), headers={"Authorization": f"Bearer {token}"}
            )
        await asyncio.gather(*list(background._pending), return_exceptions=True)  # samples and records
        return response

    return async_to_sync(go)()


def _samples(endpoint_id: int, traffic: str, bucket: str, kind: str) -> list[float]:
    import redis
    from django.conf import settings

    key = goodput.KEY.format(endpoint_id=endpoint_id, traffic=traffic, bucket=bucket, kind=kind)
    kept = redis.Redis.from_url(settings.REDIS_URL).lrange(key, 0, -1)
    return [rules.tok_s(store.parse(v)) for v in kept]


@pytest.mark.django_db(transaction=True)
def test_off_and_shadow_requests_are_plain_samples_of_their_traffic_kind(gateway):
    greedy = {"model": "guarded", "prompt": "def f():", "max_tokens": 4, "temperature": 0}
    sampled = {**greedy, "temperature": 0.7}
    # when: off serves two greedy requests and one sampled, then shadow one greedy
    for body in (greedy, greedy, sampled):
        assert _post(gateway.token, body).status_code == 200
    gateway.set_mode("shadow")
    assert _post(gateway.token, greedy).status_code == 200
    # then: each is a plain sample at load 1 of its own kind (4 tokens from the server's usage), none speculative
    plain_greedy = _samples(gateway.endpoint.pk, GREEDY, "1", PLAIN)
    assert len(plain_greedy) == 3 and all(v > 0 for v in plain_greedy)
    assert len(_samples(gateway.endpoint.pk, SAMPLED, "1", PLAIN)) == 1
    assert _samples(gateway.endpoint.pk, GREEDY, "1", SPEC) == []
    assert guard_load._in_flight[gateway.endpoint.pk] == {}  # every request counted out of flight


@pytest.mark.django_db(transaction=True)
def test_a_request_the_guard_sends_plain_is_skipped_with_the_reason_and_answered_as_off(gateway):
    from speculation.models import StageRecord

    body = {"model": "guarded", "prompt": "def f():", "max_tokens": 4, "temperature": 0}
    # given: off traffic gave plain samples, and speculation measured slower at this load
    off_answers = [_post(gateway.token, body) for _ in range(MIN_SAMPLES)]
    asyncio.run(_keep(gateway.endpoint.pk, SPEC, 0.5, n=MIN_SAMPLES))
    guard_load._in_flight.clear()
    gateway.set_mode("prod")
    # when
    answer = _post(gateway.token, body)
    # then: the answer is the server's, byte for byte as off relayed it, and the record says why
    assert answer.status_code == 200 and answer.content == off_answers[0].content
    record = StageRecord.objects.get()
    assert record.action == "skipped" and "slower than plain at this load (goodput guard)" in record.reason
    assert "0.5 vs" in record.reason
    # and: the server saw the request as off sends it (no tokenize call: the guard decides before)
    paths = [r.path for r in gateway.upstream.requests]
    assert paths == ["/v1/completions"] * (MIN_SAMPLES + 1)


def test_a_plain_sample_counts_tokens_from_the_usage_or_else_the_streamed_events():
    def sample(kind: str) -> goodput.PlainSample:
        return goodput.PlainSample(SimpleNamespace(kind=kind))

    whole = sample("completion")
    body = json.dumps(COMPLETION).encode()
    assert whole.on_body(200, body) == body and whole.tokens() == 4
    chat = sample("chat")  # a stream without usage: one event per token after the role event
    events = [{"choices": [{"delta": {"role": "assistant"}}]}] + [{"choices": [{"delta": {"content": "x"}}]}] * 3
    stream = "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"
    assert chat.on_chunk(stream[:40]) + chat.on_chunk(stream[40:]) == stream
    assert chat.tokens() == 3
    with_usage = sample("completion")
    with_usage.on_chunk(b'data: {"choices": [{"text": "a"}]}\n\n')
    with_usage.on_chunk(b'data: {"choices": [], "usage": {"completion_tokens": 7}}\n\n')
    assert with_usage.tokens() == 7


@pytest.mark.django_db(transaction=True)
def test_at_one_stream_the_guard_sends_short_requests_plain_and_lets_long_ones_speculate(gateway):
    from speculation.models import CostCalibration, StageRecord

    # given: the policy's costs measured (20 ms a target step, c = 0.05, v = 1.2) and its prod requests (E[N] = 3 at
    # K = 5, 250 ms of setup each), and speculation measured slower than plain at load 1 by short requests
    endpoint = gateway.endpoint
    CostCalibration.objects.create(
        endpoint=endpoint, node_class=endpoint.node_class, path="local", target_step_ms=20.0, draft_step_ms=1.0,
        verify_ms={"6": 24.0}, repeats=5,
    )  # fmt: skip
    StageRecord.objects.create(
        endpoint=endpoint, request_id="measured", mode="prod", action="speculated", target_passes=40,
        drafted_tokens=200, accepted_tokens=80, output_tokens=120, latency_ms=250.0 + 40 * 29.0, path="local",
        mechanism=endpoint.policy.mechanism,
    )  # fmt: skip
    asyncio.run(_keep(endpoint.pk, PLAIN, 50.0, n=MIN_SAMPLES))
    asyncio.run(_keep(endpoint.pk, SPEC, 10.0, n=MIN_SAMPLES))
    guard_load._in_flight.clear()
    gateway.set_mode("prod")
    body = {"model": "guarded", "prompt": "def f():", "temperature": 0}
    # when: a 4-token request, then a 128-token one, each alone
    short = _post(gateway.token, {**body, "max_tokens": 4})
    long = _post(gateway.token, {**body, "max_tokens": 128})

    # then: the short one is answered plain, skipped with the guard's reason
    assert short.status_code == 200 and long.status_code == 200
    records = StageRecord.objects.exclude(request_id="measured").order_by("id")
    assert [r.action for r in records] == ["skipped", "fell_back"]
    assert records[0].reason.startswith("a request of up to 4 tokens is predicted 0.")
    assert records[0].reason.endswith("(goodput guard)")
    # and: the long one passed the guard: it went on to tokenize its prompt (the stub server has no /tokenize, so it
    # then fell back to plain)
    assert "tokenize failed" in records[1].reason
    assert [r.path for r in gateway.upstream.requests][-3:] == ["/v1/completions", "/tokenize", "/v1/completions"]


def test_speculative_samples_of_another_pairing_are_dropped_and_plain_ones_kept(guard_on):
    async def run():
        # given: samples kept while prod ran on the remote path (plain ones are the server's own speed)
        await _keep(9020, SPEC, 10.0, n=MIN_SAMPLES)
        await _keep(9020, PLAIN, 50.0, n=MIN_SAMPLES)
        remote = store.pairing_of(_call(9020, "a", path="remote").route)
        local = store.pairing_of(_call(9020, "b", path="local").route)
        # when: read under the remote pairing (none recorded yet: the samples there are taken for it), then local
        first = await store.read(9020, remote)
        store.forget()
        again = await store.read(9020, remote)
        store.forget()
        moved = await store.read(9020, local)
        return first, again, moved

    first, again, moved = asyncio.run(run())

    # then: the remote pairing keeps its samples; the local one starts without speculative ones
    spec, plain = (GREEDY, "1", SPEC), (GREEDY, "1", PLAIN)
    assert len(first[spec]) == len(again[spec]) == MIN_SAMPLES
    assert spec not in moved and len(moved[plain]) == MIN_SAMPLES
