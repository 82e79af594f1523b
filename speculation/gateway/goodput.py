"""The goodput guard: prod does not speculate at a load where speculation is slower than plain serving.

Why: a server that batches well answers many streams far faster than one, while the worker's engine may not, and
sampled requests accept less and verify at more cost than greedy ones; on a machine the worker shares with the
server, a speculating request also slows the plain ones beside it. So per endpoint, traffic kind (greedy / sampled)
and load bucket (requests in flight in this web process: 1, 2-4, 5-16, 17+), the guard keeps the goodput of the
newest WINDOW requests served with speculation on and of the newest WINDOW served plain (Redis lists shared by the
web processes; plain samples come from off, shadow and plain prod requests). A request is decided at the endpoint's
peak load of the last RECENT_S seconds. The rule (`choose`):

- measured faster (goodput at least plain's over MIN_SAMPLES each; above one request in flight by CROWDED_MARGIN):
  speculate, at most ACE_GOODPUT_SPECULATING of the endpoint's requests at once above one in flight;
- measured slower (over MIN_SAMPLES, or early: the first EARLY_SAMPLES below plain's median, the first FEW_SAMPLES
  below plain's slowest) or presumed slower (slower at a lower load, or greedy slower for sampled traffic): plain;
- otherwise learn the load with one speculating request at a time (LEARNERS_IN_FLIGHT), the others plain.

Goodput is tokens / seconds over the window (each request weighted by how long it ran), and speculation's samples
include the plain requests served beside it, so the verdict is the endpoint's aggregate, not the learner's own speed.
Speculative samples expire SPEC_TTL_S after the first one, so a changed draft or machine is learned again. Where the
worker shares the server's machine (`shares_machine`) loads above one are presumed slower unless
ACE_GOODPUT_SHARED_LEARN is set; where the worker's batch takes the whole load (`batch_takes`) every request of the
load speculates together (BATCHED_MARGIN). Every decision carries its reason, kept in the stage record.
ACE_GOODPUT_GUARD=false turns it off. Measurements: docs/BENCHMARKS.md, "Concurrency".
"""

from __future__ import annotations

import functools
import ipaddress
import itertools
import logging
import re
import socket
import statistics
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

from speculation.gateway import background
from speculation.gateway.admission import single_stream
from speculation.gateway.call import Call
from speculation.gateway.channel import client
from speculation.gateway.sampling import GREEDY_BELOW
from speculation.jobs.admission import workers_key
from speculation.models import Mode

logger = logging.getLogger(__name__)

WINDOW = 20
MIN_SAMPLES = 8
EARLY_SAMPLES = 4
FEW_SAMPLES = 2
# The early rules (EARLY_SAMPLES, FEW_SAMPLES) decide above one request in flight only, where a slow learner slows its
# neighbours too. Alone it slows no one, and its first requests run while the worker warms up (a calibration beside
# them, first passes): two slightly slow ones would hold speculation off at load 1 for SPEC_TTL_S where it goes on
# to gain 1.2-2.5x (bench_gateway's shadow_vs_prod, docs/BENCHMARKS.md).
LEARNERS_IN_FLIGHT = 1
# Above one request in flight, speculation counts as faster only at this multiple of plain's goodput. The losses are
# not alike: there at most GOODPUT_SPECULATING requests speculate, so a right "faster" gains a share of one stream,
# while a wrong one slows every neighbour (8 streams, 2 cores: 3.7x); and the two sides' samples are taken at
# different moments of a drifting machine (plain's goodput per stream at 5-16 can fall by a third within a minute
# when another job starts, turning a "slower" into "faster").
CROWDED_MARGIN = 1.25
# Where the worker's batch takes every request of the load (`batch_takes`), the whole load is learned and served
# speculatively: a right "faster" gains on every stream, so the margin covers only the drift between the moments the
# two sides were sampled at (off's own rounds at 8 streams differed by 5-10 % here).
BATCHED_MARGIN = 1.1
# A verdict's goodput leaves out each side's longest-running sample: with every request weighted by its seconds, the
# worker's first request (loading the models: seconds) outweighs 7 fast ones, and one stream would go plain at a load
# where speculation runs 2x. The neighbours of a learner are several.
TRIM = 1
BUCKETS = ((1, "1"), (4, "2-4"), (16, "5-16"))
TOP_BUCKET = "17+"
BUCKET_NAMES = (*(name for _, name in BUCKETS), TOP_BUCKET)
KEY = "ace:goodput:{endpoint_id}:{traffic}:{bucket}:{kind}"
EXPIRE_S = 3600  # plain samples: refreshed with every sample
SPEC_TTL_S = 900  # speculative samples: a load's verdict lasts this long from its first sample, then is re-learned
RECENT_S = 5.0  # a request is decided at the endpoint's peak load within this long: the first of a burst starts
# alone, but on an endpoint that was just busy it will not run alone (reconsider() catches a burst that arrives while
# a request is prepared). A longer window keeps a past burst's bucket on the next, lighter rounds: their learners
# are decided at 17+ but keep their samples at their own load, so 17+ would be learned forever.
STALE_S = 900.0  # an in-flight entry older than this was lost (its record never written): no longer counted

SPEC = "spec"
PLAIN = "plain"
GREEDY = "greedy"
GUARD = "goodput guard"
SAMPLED = "sampled"
TRAFFIC = (GREEDY, SAMPLED)

Sample = float | tuple[float, float]  # a request's tok/s, with the seconds it ran (a bare tok/s weighs 1 s)
Samples = Mapping[tuple[str, str, str], Sequence[Sample]]  # (traffic, bucket, SPEC | PLAIN) -> per request


@dataclass
class _Flight:
    started: float
    area: float  # the endpoint's load integral when it started (_Load)
    probe: tuple[str, str] | None = None  # (traffic, bucket) it speculates to learn
    speculating: bool = False
    beside: bool = False  # served plain while a request of the endpoint speculated (its sample is speculation's)


@dataclass
class _Load:
    """The integral over time of an endpoint's requests in flight, so a request's mean load is known at its end."""

    area: float = 0.0
    at: float = 0.0
    peak: int = 0  # the most requests in flight at once within RECENT_S (refreshed whenever reached again)
    peak_at: float = 0.0


_now = time.monotonic
_in_flight: dict[int, dict[str, _Flight]] = defaultdict(dict)
_load: dict[int, _Load] = defaultdict(_Load)
_turns: dict[tuple[int, str, str], itertools.count] = defaultdict(itertools.count)
# (endpoint, traffic, bucket) -> when a "slower" verdict above one request in flight was reached: it holds while the
# load's speculative samples live (SPEC_TTL_S), whatever plain's newer samples say (see CROWDED_MARGIN)
_held: dict[tuple[int, str, str], float] = {}


@dataclass(frozen=True)
class Decision:
    plain: bool
    reason: str = ""
    probe: bool = False  # speculates to learn a load that has no verdict yet
    samples: Samples | None = field(default=None, compare=False, repr=False)  # what it was decided on (reconsider)
    shared: bool = field(default=False, compare=False, repr=False)  # the worker shares the server's machine
    batched: bool = field(default=False, compare=False, repr=False)  # the worker's batch takes the whole load


def bucket_of(in_flight: int) -> str:
    for bound, name in BUCKETS:
        if in_flight <= bound:
            return name
    return TOP_BUCKET


def traffic_of(body: Mapping[str, Any]) -> str:
    """Greedy or sampled, as the server reads the request (no temperature: OpenAI's and vLLM's default, 1)."""
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature < GREEDY_BELOW:
        return GREEDY
    return SAMPLED


def _advance(endpoint_id: int, now: float) -> _Load:
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
    flying[call.request_id] = _Flight(started=now, area=load.area, beside=beside)
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


def _learning(endpoint_id: int) -> int:
    return sum(1 for f in _in_flight[endpoint_id].values() if f.probe is not None)


def _speculating(endpoint_id: int) -> int:
    return sum(1 for f in _in_flight[endpoint_id].values() if f.speculating)


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


def _pending(endpoint_id: int, request_id: str) -> int:
    """The endpoint's other requests in flight whose samples will be speculation's."""
    return sum(1 for rid, f in _in_flight[endpoint_id].items() if rid != request_id and (f.speculating or f.beside))


def _tok_s(sample: Sample) -> float:
    return sample[0] if isinstance(sample, tuple) else float(sample)


def goodput(samples: Sequence[Sample], *, trim: int = 0) -> float:
    """Tokens / seconds over the samples: each request's tok/s weighted by the seconds it ran; `trim`: without that
    many of the longest-running ones (a worker's cold start, a pause: one request must not decide alone)."""
    pairs = [s if isinstance(s, tuple) else (float(s), 1.0) for s in samples]
    if trim and len(pairs) > trim:
        pairs = sorted(pairs, key=lambda pair: pair[1])[:-trim]
    seconds = sum(sec for _, sec in pairs)
    return sum(rate * sec for rate, sec in pairs) / seconds if seconds > 0 else 0.0


def verdict(
    spec: Sequence[Sample], plain: Sequence[Sample], *, bucket: str = BUCKET_NAMES[0], batched: bool = False
) -> str:
    """ "slower" / "faster" where the samples of one load say so, "" where they do not yet. Above one request in
    flight "faster" needs CROWDED_MARGIN times plain's goodput ("slower" covers "not that much faster"), or
    BATCHED_MARGIN where the worker's batch takes the whole load."""
    if len(plain) < MIN_SAMPLES:
        return ""
    if len(spec) >= MIN_SAMPLES:
        margin = 1.0 if bucket == BUCKET_NAMES[0] else BATCHED_MARGIN if batched else CROWDED_MARGIN
        return "slower" if goodput(spec, trim=TRIM) < margin * goodput(plain, trim=TRIM) else "faster"
    if bucket == BUCKET_NAMES[0]:  # alone, a request slows no neighbour: MIN_SAMPLES decide (see FEW_SAMPLES)
        return ""
    spec_rates, plain_rates = [_tok_s(s) for s in spec], [_tok_s(s) for s in plain]
    if len(spec) >= EARLY_SAMPLES and max(spec_rates) < statistics.median(plain_rates):
        return "slower"
    if len(spec) >= FEW_SAMPLES and max(spec_rates) < min(plain_rates):
        return "slower"
    return ""


def _figures(spec: Sequence[Sample], plain: Sequence[Sample]) -> str:
    return (
        f"goodput {goodput(spec, trim=TRIM):.1f} vs {goodput(plain, trim=TRIM):.1f} tok/s per stream (tokens / "
        f"seconds, each side's longest request left out) over the last {len(spec)} / {len(plain)} requests"
    )


def presumed_slower(samples: Samples, *, traffic: str, bucket: str) -> str:
    """Why speculation is presumed slower at a load it has not been measured at enough ("" when it is not)."""

    def slower(kind: str, name: str) -> bool:
        spec, plain = samples.get((kind, name, SPEC), ()), samples.get((kind, name, PLAIN), ())
        return verdict(spec, plain, bucket=name) == "slower"

    lower = BUCKET_NAMES[: BUCKET_NAMES.index(bucket)]
    for name in reversed(lower):
        if slower(traffic, name):
            return f"{traffic} speculation measured slower than plain at the lower load {name}"
    if traffic == SAMPLED:
        for name in reversed((*lower, bucket)):
            if slower(GREEDY, name):
                return f"greedy speculation measured slower than plain at load {name}"
    return ""


def choose(
    samples: Samples,
    *,
    traffic: str,
    bucket: str,
    turn: int,
    learning: int = 0,
    speculating: int = 0,
    pending: int = 0,
    held: bool = False,
    shared: bool = False,
    batched: bool = False,
) -> Decision:
    """The rule, on the samples of one endpoint, for a request of this traffic at this load; turn counts the
    requests of that traffic and load, learning the endpoint's speculated requests in flight that learn a load,
    speculating all its speculated requests in flight, pending its other requests in flight whose samples will be
    speculation's (the speculating ones and the plain ones beside them), held whether a "slower" verdict reached
    earlier at this load still holds (hold_slower), shared whether the worker's engine shares the server's machine
    (shares_machine: then a load above one request in flight without a verdict is presumed slower, not learned),
    batched whether the worker's batch takes every request of this load (batch_takes: then the load is learned and,
    measured faster, served with every request speculating, the regime it was measured in; decide() passes it only
    where the worker does not share the server's machine)."""
    spec, plain = samples.get((traffic, bucket, SPEC), ()), samples.get((traffic, bucket, PLAIN), ())
    own = "slower" if held else verdict(spec, plain, bucket=bucket, batched=batched)
    if own == "faster":
        cap = max(1, int(getattr(settings, "GOODPUT_SPECULATING", 1)))
        if batched:
            return Decision(
                plain=False,
                reason=f"{GUARD}: speculation measured faster at load {bucket} with the load on the worker's batch",
            )
        if bucket != BUCKET_NAMES[0] and speculating >= cap:
            return Decision(
                plain=True,
                reason=f"speculation measured faster at load {bucket} with at most {cap} of the endpoint's requests "
                f"speculating; {speculating} already are ({GUARD})",
            )
        return Decision(plain=False, reason=f"{GUARD}: speculation measured faster at load {bucket}")
    if held:
        return Decision(
            plain=True,
            reason=f"speculation measured slower than plain at this load, a verdict held {SPEC_TTL_S} s ({GUARD}); "
            f"now {_figures(spec, plain)}",
        )
    if own == "slower":
        if len(spec) >= MIN_SAMPLES and goodput(spec, trim=TRIM) >= goodput(plain, trim=TRIM):  # within the margin
            return Decision(
                plain=True,
                reason=f"speculation measured less than {CROWDED_MARGIN}x plain's goodput at this load ({GUARD}): "
                f"{_figures(spec, plain)}",
            )
        return Decision(
            plain=True,
            reason=f"speculation measured slower than plain at this load ({GUARD}): {_figures(spec, plain)}",
        )
    presumed = presumed_slower(samples, traffic=traffic, bucket=bucket)
    if not presumed and shared and bucket != BUCKET_NAMES[0]:
        presumed = SHARED_REASON
    if presumed:
        return Decision(plain=True, reason=f"{presumed}; not measured at load {bucket} ({GUARD})")
    if len(plain) < MIN_SAMPLES and len(spec) >= MIN_SAMPLES and turn % 2 == 1:
        return Decision(plain=True, reason=f"measuring plain speed at this load ({GUARD})")
    if batched and bucket != BUCKET_NAMES[0]:
        return Decision(
            plain=False, reason=f"{GUARD}: learning load {bucket} with the load on the worker's batch", probe=True
        )
    if learning >= LEARNERS_IN_FLIGHT:
        return Decision(
            plain=True,
            reason=f"learning load {bucket}: a speculated request in flight measures it first ({GUARD})",
        )
    if pending and len(spec) + pending >= MIN_SAMPLES:
        return Decision(
            plain=True,
            reason=f"learning load {bucket}: the {pending} requests in flight beside speculation finish first, "
            f"{len(spec)} of its samples kept ({GUARD})",
        )
    return Decision(plain=False, reason=f"{GUARD}: learning load {bucket}", probe=True)


SHARED_REASON = (
    "the worker's engine shares the server's machine: a speculating request takes the cores the plain ones beside "
    "it wait for (ACE_GOODPUT_SHARED_LEARN=true learns this load instead)"
)
SHARED_TTL_S = 30.0  # how long the gateway keeps its finding per (node class, server host)
_shared: dict[tuple[str, str], tuple[float, bool]] = {}


@functools.cache
def _this_machine() -> frozenset[str]:
    """This host's names and addresses, looked up once per process (the lookups may ask DNS)."""
    names = {socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return frozenset(names)


def server_on_this_machine(base_url: str) -> bool:
    """Whether the endpoint's server runs on the machine of this web process: a loopback address or this host."""
    from urllib.parse import urlsplit

    host = (urlsplit(base_url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return host in _this_machine()


def worker_machines(members: Sequence[bytes | str]) -> set[str]:
    """The machines of the capacity members "<celery node name>|<slots>" (speculation.jobs.admission): a node name
    is "<name>@<host>" (Celery's default is "celery@<hostname>")."""
    machines = set()
    for member in members:
        text = member.decode() if isinstance(member, bytes) else member
        node = text.rsplit("|", 1)[0]
        machines.add(node.rpartition("@")[2].lower())
    return machines


async def shares_machine(route: Any) -> bool:
    """Whether the worker's engine would run on the same machine as the endpoint's server: the server is on this
    machine and a live worker of the endpoint's node class declares capacity from this machine. Kept SHARED_TTL_S."""
    if getattr(settings, "GOODPUT_SHARED_LEARN", False):
        return False
    key, now = (route.node_class, route.base_url), _now()
    found = _shared.get(key)
    if found is not None and now - found[0] < SHARED_TTL_S:
        return found[1]
    if not server_on_this_machine(route.base_url):
        _shared[key] = (now, False)
        return False
    shared = bool(worker_machines(await live_workers(route.node_class)) & _this_machine())
    _shared[key] = (now, shared)
    return shared


_workers: dict[str, tuple[float, list]] = {}  # node class -> (when read, its live workers' capacity members)


async def live_workers(node_class: str) -> list:
    """The capacity members "<node>|<slots>" the live workers of a node class declare to admission control
    (speculation.jobs.admission), read once per SHARED_TTL_S for shares_machine and batch_takes alike."""
    now = _now()
    found = _workers.get(node_class)
    if found is None or now - found[0] >= SHARED_TTL_S:
        found = _workers[node_class] = (now, await client().zrangebyscore(workers_key(node_class), time.time(), "+inf"))
    return found[1]


def _slots(members: Sequence[bytes | str]) -> int:
    total = 0
    for member in members:
        slots = (member.decode() if isinstance(member, bytes) else member).rpartition("|")[2]
        total += int(slots) if slots.isdigit() else 0
    return total


async def batch_takes(route: Any, load: int) -> bool:
    """Whether the worker's batch serves this endpoint's prod requests (admission.single_stream says it does not)
    and its live workers' slots take a load of this many requests at once: then every request of the load can
    speculate together and the server sits idle, instead of a few speculating beside plain ones."""
    if load <= 1 or single_stream(path=route.path, mechanism=route.mechanism):
        return False
    return _slots(await live_workers(route.node_class)) >= load


# The samples read from Redis are reused by this process for READ_TTL_S, with the samples it keeps itself added as it
# keeps them (`_remember`): reading all 16 lists per prod request was the largest part of a plain prod request's cost
# in the web process (docs/BENCHMARKS.md, "Plain path"). Another process's samples, and a list that
# expired in Redis, are seen within READ_TTL_S.
READ_TTL_S = 1.0
_NAMES = tuple((traffic, bucket, kind) for traffic in TRAFFIC for bucket in BUCKET_NAMES for kind in (SPEC, PLAIN))
_read_cache: dict[int, tuple[float, dict[tuple[str, str, str], list[Sample]]]] = {}


async def _read(endpoint_id: int) -> dict[tuple[str, str, str], list[Sample]]:
    """The endpoint's kept samples, newest first, per (traffic, bucket, kind); from this process's copy when it was
    read within READ_TTL_S."""
    now = time.monotonic()
    found = _read_cache.get(endpoint_id)
    if found is not None and now - found[0] < READ_TTL_S:
        return found[1]
    pipe = client().pipeline(transaction=False)
    for traffic, bucket, kind in _NAMES:
        pipe.lrange(KEY.format(endpoint_id=endpoint_id, traffic=traffic, bucket=bucket, kind=kind), 0, WINDOW - 1)
    raws = await pipe.execute()
    samples = {name: [_parse(v) for v in raw] for name, raw in zip(_NAMES, raws, strict=True) if raw}
    _read_cache[endpoint_id] = (now, samples)
    return samples


def _remember(endpoint_id: int, name: tuple[str, str, str], sample: Sample) -> None:
    """A sample this process kept, added to its copy of the endpoint's samples (a new list: a decision made on the
    copy keeps what it was decided on)."""
    found = _read_cache.get(endpoint_id)
    if found is not None:
        _read_cache[endpoint_id] = (found[0], {**found[1], name: [sample, *found[1].get(name, ())][:WINDOW]})


def forget_samples() -> None:
    """Drop this process's copies: the next decision reads Redis (tests; a process that learns a list expired)."""
    _read_cache.clear()


def _parse(raw: bytes | str) -> Sample:
    """A kept sample: "tok/s:seconds" (a bare tok/s, an older format, weighs 1 s)."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    rate, _, seconds = text.partition(":")
    return (float(rate), float(seconds)) if seconds else float(rate)


async def decide(call: Call) -> Decision:
    """Begin the request (count it in flight) and say whether it speculates. Plain when the guard is off never."""
    bucket = begin(call)
    if not settings.GOODPUT_GUARD:
        return Decision(plain=False)
    endpoint_id = call.route.endpoint_id
    try:
        samples = await _read(endpoint_id)
        shared = await shares_machine(call.route)
    except (aioredis.RedisError, OSError) as exc:  # no measurement: speculate as without the guard
        logger.warning("goodput guard: Redis unavailable (%s)", exc)
        return Decision(plain=False)
    # the peak again: requests of a burst that arrived during the read count (the first would be decided alone)
    peak = max(1, _load[endpoint_id].peak)
    try:  # not where the worker shares the server's machine: measured no faster there, and learning costs a round
        batched = not shared and await batch_takes(call.route, peak)
    except (aioredis.RedisError, OSError):
        batched = False
    call.load_bucket = bucket = bucket_of(peak)
    turn = next(_turns[(endpoint_id, call.traffic, bucket)])
    decision = choose(
        samples, traffic=call.traffic, bucket=bucket, turn=turn, learning=_learning(endpoint_id),
        speculating=_speculating(endpoint_id), pending=_pending(endpoint_id, call.request_id),
        held=hold_slower(endpoint_id, samples, traffic=call.traffic, bucket=bucket, batched=batched), shared=shared,
        batched=batched,
    )  # fmt: skip
    _mark(call, decision)
    return Decision(decision.plain, decision.reason, decision.probe, samples=samples, shared=shared, batched=batched)


def _mark(call: Call, decision: Decision) -> None:
    flying = _in_flight[call.route.endpoint_id]
    flight = flying.get(call.request_id)
    if flight is not None:
        flight.probe = (call.traffic, call.load_bucket) if decision.probe and not decision.plain else None
        flight.speculating = not decision.plain
        if flight.speculating:  # every request now beside it pays for it too
            for other in flying.values():
                other.beside = True


def reconsider(call: Call, decision: Decision) -> Decision:
    """Just before a speculating request goes to the worker (after tokenizing): if the endpoint's peak load rose into
    a higher bucket since it was decided (the rest of a burst arrived meanwhile), the rule again at that load, on the
    samples it was decided on (no second Redis read). The first request of a burst is otherwise decided alone."""
    endpoint_id = call.route.endpoint_id
    bucket = bucket_of(max(1, _load[endpoint_id].peak))
    if decision.plain or decision.samples is None or not call.load_bucket:
        return decision
    if BUCKET_NAMES.index(bucket) <= BUCKET_NAMES.index(call.load_bucket):
        return decision
    _mark(call, Decision(plain=True))  # not counted as learning while it is decided again
    read = _workers.get(call.route.node_class)  # read by decide (no Redis round trip here)
    batched = decision.batched and read is not None and _slots(read[1]) >= _load[endpoint_id].peak
    again = choose(
        decision.samples, traffic=call.traffic, bucket=bucket, turn=0, learning=_learning(endpoint_id),
        speculating=_speculating(endpoint_id), pending=_pending(endpoint_id, call.request_id),
        held=hold_slower(endpoint_id, decision.samples, traffic=call.traffic, bucket=bucket, batched=batched),
        shared=decision.shared, batched=batched,
    )  # fmt: skip
    call.load_bucket = bucket
    if again.plain:
        again = Decision(plain=True, reason=f"{again.reason}; the load rose to {bucket} while it was prepared")
    _mark(call, again)
    return again


async def observe(call: Call, *, kind: str, tokens: int | None, latency_ms: float) -> None:
    """Keep a finished request's tok/s in its sample (kind SPEC or PLAIN) at the mean load it ran under, and count
    it out of flight."""
    flight = _in_flight[call.route.endpoint_id].get(call.request_id)
    if kind == PLAIN and flight is not None and flight.beside and not flight.speculating:
        kind = SPEC  # what speculating at this load cost a plain neighbour: part of speculation's goodput
    mean_load = end(call)
    bucket = bucket_of(max(1, round(mean_load))) if mean_load is not None else getattr(call, "load_bucket", "")
    if not bucket or not tokens or latency_ms <= 0:
        return
    key = KEY.format(endpoint_id=call.route.endpoint_id, traffic=call.traffic or SAMPLED, bucket=bucket, kind=kind)
    seconds = latency_ms / 1000.0
    _remember(call.route.endpoint_id, (call.traffic or SAMPLED, bucket, kind), (tokens / seconds, seconds))
    try:
        pipe = client().pipeline(transaction=False)
        pipe.lpush(key, f"{tokens / seconds:.3f}:{seconds:.3f}")
        pipe.ltrim(key, 0, WINDOW - 1)
        if kind == SPEC:
            pipe.expire(key, SPEC_TTL_S, nx=True)  # from the first sample: the verdict lasts SPEC_TTL_S
        else:
            pipe.expire(key, EXPIRE_S)
        await pipe.execute()
    except (aioredis.RedisError, OSError) as exc:
        logger.warning("goodput guard: could not keep a sample (%s)", exc)


_USAGE = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_EVENT = b"data: {"


class TokenCount:
    """The output tokens of an answer relayed as the server sent it, found with one regular expression per body or
    chunk and no JSON parsed (the off path stays a relay; a plain prod request pays no more): the usage the server
    reports, else (a stream without usage) the number of events, less a chat stream's first, which carries the role
    only."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.usage: int | None = None
        self.events = 0

    def body(self, body: bytes) -> None:
        found = _USAGE.search(body)
        if found:
            self.usage = int(found.group(1))

    def chunk(self, chunk: bytes) -> None:
        self.events += chunk.count(_EVENT)
        if b'"completion_tokens"' in chunk:
            found = _USAGE.search(chunk)
            if found:
                self.usage = int(found.group(1))

    def tokens(self) -> int:
        if self.usage is not None:
            return self.usage
        role_event = 1 if self.kind == "chat" else 0
        return max(0, self.events - role_event)


class PlainSample:
    """Observer of an off or shadow request (wrapping shadow's own, if any): its tok/s becomes a plain sample, its
    tokens counted by TokenCount."""

    def __init__(self, call: Call, inner: Any = None) -> None:
        self.call = call
        self.inner = inner
        self.count = TokenCount(call.kind)

    def on_body(self, status: int, body: bytes) -> bytes:
        self.count.body(body)
        return self.inner.on_body(status, body) if self.inner is not None else body

    def on_chunk(self, chunk: bytes) -> bytes:
        self.count.chunk(chunk)
        return self.inner.on_chunk(chunk) if self.inner is not None else chunk

    def tokens(self) -> int:
        return self.count.tokens()

    async def on_done(self, status: int, error: str = "") -> None:
        if self.inner is not None:
            await self.inner.on_done(status, error)
        tokens = self.tokens()
        if status != 200 or error or not tokens:
            end(self.call)
            return
        background.spawn(
            observe(self.call, kind=PLAIN, tokens=tokens, latency_ms=self.call.elapsed_ms()), what="goodput sample"
        )


def watch(call: Call, observer: Any = None) -> Any:
    """For an off or shadow request with the guard on: count it in flight and wrap its observer so that its tok/s
    is kept as a plain sample. Prod requests record their own samples (the observer is returned as it is)."""
    if not settings.GOODPUT_GUARD or call.route.mode == Mode.PROD:
        return observer
    begin(call)
    return PlainSample(call, observer)
