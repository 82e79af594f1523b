"""In-flight counting per endpoint in this web process: the load a request is decided at (the peak of the last
RECENT_S seconds), the mean load it ran under (kept with its sample), and which requests in flight speculate, learn
a load, or run beside a speculating one (their samples are speculation's)."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass

from speculation.gateway.call import Call
from speculation.gateway.guard.rules import (
    BUCKET_NAMES,
    PLAIN,
    SPEC,
    SPEC_TTL_S,
    Decision,
    Samples,
    bucket_of,
    traffic_of,
    verdict,
)

RECENT_S = 5.0  # a request is decided at the endpoint's peak load within this long: the first of a burst starts
# alone, but on an endpoint that was just busy it will not run alone (reconsider() catches a burst that arrives while
# a request is prepared). A longer window keeps a past burst's bucket on the next, lighter rounds.
STALE_S = 900.0  # an in-flight entry older than this was lost (its record never written): no longer counted


@dataclass
class Flight:
    started: float
    area: float  # the endpoint's load integral when it started (Load)
    probe: tuple[str, str] | None = None  # (traffic, bucket) it speculates to learn
    speculating: bool = False
    beside: bool = False  # served plain while a request of the endpoint speculated (its sample is speculation's)


@dataclass
class Load:
    """The integral over time of an endpoint's requests in flight, so a request's mean load is known at its end."""

    area: float = 0.0
    at: float = 0.0
    peak: int = 0  # the most requests in flight at once within RECENT_S (refreshed whenever reached again)
    peak_at: float = 0.0


_now = time.monotonic
_in_flight: dict[int, dict[str, Flight]] = defaultdict(dict)
_load: dict[int, Load] = defaultdict(Load)
_turns: dict[tuple[int, str, str], itertools.count] = defaultdict(itertools.count)
# (endpoint, traffic, bucket) -> when a "slower" verdict above one request in flight was reached: it holds while the
# load's speculative samples live (SPEC_TTL_S), whatever plain's newer samples say (see rules.CROWDED_MARGIN)
_held: dict[tuple[int, str, str], float] = {}


def _advance(endpoint_id: int, now: float) -> Load:
    load = _load[endpoint_id]
    load.area += len(_in_flight[endpoint_id]) * (now - load.at) if load.at else 0.0
    load.at = now
    return load


def begin(call: Call) -> str:
    """Count the request in flight for its endpoint; the load bucket the guard decides it by: the most requests in
    flight at once (itself included) within the last RECENT_S."""
    now = _now()
    load = _advance(call.route.endpoint_id, now)
    flying = _in_flight[call.route.endpoint_id]
    for request_id, flight in list(flying.items()):
        if now - flight.started > STALE_S:
            del flying[request_id]
    beside = any(f.speculating for f in flying.values())
    flying[call.request_id] = Flight(started=now, area=load.area, beside=beside)
    if len(flying) >= load.peak or now - load.peak_at > RECENT_S:
        load.peak, load.peak_at = len(flying), now
    call.load_bucket = bucket_of(load.peak)
    call.traffic = traffic_of(call.body)
    return call.load_bucket


def end(call: Call) -> float | None:
    """Count the request out of flight; the endpoint's mean load while it ran (None if it was not counted).

    A sample is kept at the load it ran under: the first request of a burst starts alone but runs among all."""
    now = _now()
    load = _advance(call.route.endpoint_id, now)
    flight = _in_flight[call.route.endpoint_id].pop(call.request_id, None)
    if flight is None:
        return None
    if now - flight.started <= 0:
        return float(len(_in_flight[call.route.endpoint_id]) + 1)
    return (load.area - flight.area) / (now - flight.started)


def peak(endpoint_id: int) -> int:
    """The endpoint's peak load of the last RECENT_S (at least 1)."""
    return max(1, _load[endpoint_id].peak)


def turn(endpoint_id: int, traffic: str, bucket: str) -> int:
    """Counts the requests of this endpoint, traffic and load (rules alternate on it)."""
    return next(_turns[(endpoint_id, traffic, bucket)])


def learning(endpoint_id: int) -> int:
    return sum(1 for f in _in_flight[endpoint_id].values() if f.probe is not None)


def speculating(endpoint_id: int) -> int:
    return sum(1 for f in _in_flight[endpoint_id].values() if f.speculating)


def pending(endpoint_id: int, request_id: str) -> int:
    """The endpoint's other requests in flight whose samples will be speculation's."""
    return sum(1 for rid, f in _in_flight[endpoint_id].items() if rid != request_id and (f.speculating or f.beside))


def beside_only(call: Call) -> bool:
    """Whether the request was served plain beside a speculating one (its sample then counts as speculation's)."""
    flight = _in_flight[call.route.endpoint_id].get(call.request_id)
    return flight is not None and flight.beside and not flight.speculating


def mark(call: Call, decision: Decision) -> None:
    """Note whether the request speculates (and learns its load): every request now beside it pays for it too."""
    flying = _in_flight[call.route.endpoint_id]
    flight = flying.get(call.request_id)
    if flight is not None:
        flight.probe = (call.traffic, call.load_bucket) if decision.probe and not decision.plain else None
        flight.speculating = not decision.plain
        if flight.speculating:
            for other in flying.values():
                other.beside = True


def hold_slower(endpoint_id: int, samples: Samples, *, traffic: str, bucket: str, batched: bool = False) -> bool:
    """Whether a "slower" verdict of this crowded load holds (reached within SPEC_TTL_S and its speculative samples
    still kept); a new one is remembered here. At one request in flight verdicts follow the samples."""
    key, spec = (endpoint_id, traffic, bucket), samples.get((traffic, bucket, SPEC), ())
    if bucket == BUCKET_NAMES[0] or not spec:
        _held.pop(key, None)
        return False
    now = _now()
    if key in _held and now - _held[key] < SPEC_TTL_S:
        return True
    _held.pop(key, None)
    if verdict(spec, samples.get((traffic, bucket, PLAIN), ()), bucket=bucket, batched=batched) == "slower":
        _held[key] = now
    return False
