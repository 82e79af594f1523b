"""c and v for shadow's projection, measured on this worker (the endpoint's node class) and kept in the database.

One calibration measures (repeated timings; the worker's own work: its fastest repeat, speculation.engine.costs;
the server's step: the median, as the server runs under its own load). The fastest, not the median, of the worker's
timings: they run while the server serves shadow's traffic on the same node, which prod's steps do not share.
(Where prod batches, the batch decoder's steps are timed in the batch loop's thread after the server has gone
quiet, and there the median: ``_batch_step_costs``; where prod runs a model's drafts single-stream, the engine
loop's own steps, relay included, likewise: ``_single_step_costs``.) With the median, shadow's projection under
load came out several times below what prod then measured (docs/BENCHMARKS.md, "Shadow against prod"). What is
timed:
- the target step: the server's plain decode step, (T(1 + N tokens) - T(1 token)) / N of a greedy plain
  generation, so prefill, HTTP round trip and request overhead cancel (not a request's latency per token);
- the draft step: this worker's draft proposing over a warm cache (0 for n-gram lookup);
- verify(n): one verification of n tokens on prod's path: the target loaded in this worker (local), or the
  server's scoring call (remote: prod's own RemoteTarget).
c = draft step / target step, v(K) = verify(K + 1) / target step: the same cost model as the lookahead
controller (speculation.engine.projection.StepCosts). The server step and verify(n) do not depend on the draft, so
a calibration of another draft on the same endpoint, path and node class younger than COST_REFRESH_S lends them:
a second candidate costs only its own draft-step timing.

Where it runs: never inside the shadow task. A shadow measurement projects with the newest stored calibration
(`shadow_costs`) and, when that is older than COST_REFRESH_S or missing, queues one refresh (`request_calibration`)
on the node class's background queue (speculation.jobs.queue: speculation.worker.tasks.calibrate_costs_task).
A record made before any calibration existed says "calibration pending" and gets its projection when the
calibration is stored (speculation.services.costs.project_pending_records). One calibration per endpoint, node
class, path and draft runs at a time across workers (a Redis lock with a TTL), and a refresh queued twice measures
once (the second finds the first's row fresh).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import redis
from django.conf import settings
from django.utils import timezone

from fleet.adapters import Unsupported, WireError, wire_for
from fleet.models import Endpoint
from speculation import drafting
from speculation.drafting.build import PathUnavailable
from speculation.engine import LocalTarget, NgramProposer
from speculation.engine.costs import REPEATS, non_decreasing, time_draft_step, time_verify
from speculation.engine.families import implementation_of
from speculation.engine.projection import MAX_PROJECTED_K, StepCosts
from speculation.jobs import queue
from speculation.models import (
    LOOKUP_KINDS,
    CostCalibration,
    DraftModel,
    Mechanism,
    SpeculationPolicy,
    VerificationPath,
)
from speculation.selectors import costs as cost_selectors
from speculation.selectors.options import effective_path
from speculation.services import costs as cost_service
from speculation.worker import cpuload, upstream
from speculation.worker.paths import resources
from speculation.worker.paths.remote import RemoteVerificationError
from speculation.worker.step_timing import BatchStepTimer, SingleStepTimer, StepRelay, waited

logger = logging.getLogger(__name__)

SERVER_STEP_TOKENS = 16  # the plain generation's extra tokens the decode step is read from
SERVER_REPEATS = 3
CONTEXT_TOKENS = 64  # the context the timings run after (the request's prompt, cut)
VERIFY_SIZES = (1, 2, 3, 5, MAX_PROJECTED_K + 1)  # tokens verified; the others are interpolated
SERVER_TIMEOUT = httpx.Timeout(connect=5.0, read=120.0, write=30.0, pool=30.0)
LOCK_TTL_S = 900  # one calibration at a time per key; longer than any seen (191 s at load 30), freed if a worker dies
QUEUED_TTL_S = 300  # a refresh queued is not queued again meanwhile (one per key on the background queue)
QUIET_WAIT_S = 5.0  # per timing of the worker's own costs (its rounds together): how long it waits for an idle server
QUIET_POLL_S = 0.05
# and the node's cores: other processes below this share of them, at least half a core (a server that has answered
# may still spin one: speculation.worker.cpuload; on 2 cores one spinning core is half the machine, on 64 it is not)
QUIET_CPU_SHARE = 0.25
PENDING = "calibration pending"  # in a record's reason until its projection is filled in

_measuring = threading.Lock()  # one calibration at a time per worker process


class CalibrationError(RuntimeError):
    """The costs could not be measured now (the server unreachable, an unexpected answer)."""


@dataclass(frozen=True)
class CostKey:
    """What one calibration is for: an endpoint on a node class, prod's path and a draft (None: a lookup kind, n-gram
    or suffix decoding: they share one calibration, the target's verification, with the n-gram lookup timed as
    their draft step; a suffix lookup costs about 0.1 ms a step here, 2.6 % of a demo-v10 target step)."""

    endpoint_id: int
    node_class: str
    path: str
    draft_id: int | None

    @property
    def tag(self) -> str:
        return f"{self.path}/{self.draft_id or 'ngram'}"

    def redis_key(self, what: str) -> str:
        return f"ace:calibration-{what}:{self.endpoint_id}:{self.node_class}:{self.tag}"


def projected_path(*, policy: SpeculationPolicy, endpoint: Endpoint) -> str:
    """The path shadow projects for: local when prod would verify in the worker, else the server's scoring."""
    path = effective_path(policy=policy, endpoint=endpoint)
    return VerificationPath.LOCAL if path == VerificationPath.LOCAL and policy.target_path else VerificationPath.REMOTE


def cost_key(*, endpoint: Endpoint, policy: SpeculationPolicy) -> CostKey:
    path = projected_path(policy=policy, endpoint=endpoint)
    return CostKey(endpoint.pk, endpoint.node_class, path, policy.draft_id)


def stored_costs(key: CostKey) -> tuple[CostCalibration | None, bool]:
    """The newest calibration for the key (any age), and whether it is younger than COST_REFRESH_S."""
    row = cost_selectors.newest_calibration(
        endpoint_id=key.endpoint_id, node_class=key.node_class, path=key.path, draft_id=key.draft_id
    )
    fresh = row is not None and row.measured_at >= timezone.now() - timedelta(seconds=settings.COST_REFRESH_S)
    return row, fresh


def _redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=2)


def request_calibration(*, endpoint: Endpoint, policy: SpeculationPolicy, context: list[int]) -> str:
    """Queue one calibration of the policy's costs on the node class's background queue, unless one is queued
    already (QUEUED_TTL_S); returns what happened, for the record's reason."""
    key = cost_key(endpoint=endpoint, policy=policy)
    try:
        if not _redis().set(key.redis_key("queued"), 1, nx=True, ex=QUEUED_TTL_S):
            return "a calibration is queued"
        queue.enqueue_calibration(node_class=endpoint.node_class, **calibration_job(key, policy, context))
    except Exception as exc:  # noqa: BLE001 - Redis or the broker down: the measurement is recorded anyway
        logger.warning("queueing a cost calibration of endpoint %s failed: %s", endpoint.pk, exc)
        return f"the calibration could not be queued ({type(exc).__name__})"
    return "a calibration was queued"


def calibration_job(key: CostKey, policy: SpeculationPolicy, context: list[int]) -> dict[str, Any]:
    """The calibration task's arguments (JSON): enough to rebuild the policy's draft and path in the worker."""
    return {
        "endpoint_id": key.endpoint_id,
        "path": key.path,
        "mechanism": policy.mechanism,
        "draft_id": policy.draft_id,
        "target_path": policy.target_path or "",
        "context": list(context[:CONTEXT_TOKENS]),
    }


def shadow_costs(*, endpoint: Endpoint, policy: SpeculationPolicy, context: list[int]) -> tuple[Any, str]:
    """The newest stored calibration for shadow's projection (None before the first one), and a note for the
    record; a stale or missing one queues a refresh. Never measures here: shadow stays cheap."""
    row, fresh = stored_costs(cost_key(endpoint=endpoint, policy=policy))
    if fresh:
        return row, ""
    queued = request_calibration(endpoint=endpoint, policy=policy, context=context)
    return row, f"older than {settings.COST_REFRESH_S} s, {queued}" if row is not None else queued


def calibrate(
    *, endpoint_id: int, path: str, mechanism: str, draft_id: int | None, target_path: str, context: list[int]
) -> CostCalibration | None:
    """The background task's body: measure and store one calibration, unless a fresh one exists or another worker
    holds the key's lock (None then). Records that waited for it get their projection."""
    endpoint = Endpoint.objects.get(pk=endpoint_id)
    draft = DraftModel.objects.filter(pk=draft_id).first() if draft_id else None
    policy = SpeculationPolicy(endpoint=endpoint, mechanism=mechanism, draft=draft, target_path=target_path)
    key = CostKey(endpoint.pk, endpoint.node_class, path, draft.pk if draft else None)
    try:
        row = _measure_once(key, endpoint=endpoint, policy=policy, context=context)
    finally:
        _redis().delete(key.redis_key("queued"))  # a later stale read may queue the next refresh
    if row is not None:
        projected = cost_service.project_pending_records(calibration=row, tag=key.tag, pending=PENDING)
        if projected:
            logger.info("calibration %s: projected %d records that waited for it", row.pk, projected)
    return row


def current_costs(*, endpoint: Endpoint, policy: SpeculationPolicy, context: list[int]) -> CostCalibration:
    """For background work (candidate replays, the calibrate command): the fresh calibration, else measured now
    under the key's lock; while another worker measures it, the newest stored one (CalibrationError if none)."""
    key = cost_key(endpoint=endpoint, policy=policy)
    row, fresh = stored_costs(key)
    if fresh:
        return row
    measured = _measure_once(key, endpoint=endpoint, policy=policy, context=context)
    if measured is not None:
        return measured
    newest, _ = stored_costs(key)
    if newest is None:
        raise CalibrationError("another worker is measuring these costs now")
    return newest


def _measure_once(
    key: CostKey, *, endpoint: Endpoint, policy: SpeculationPolicy, context: list[int]
) -> CostCalibration | None:
    """Measure and store under the key's Redis lock; the row found fresh, or None while another worker holds it."""
    client, token = _redis(), uuid.uuid4().hex
    lock = key.redis_key("lock")
    try:
        if not client.set(lock, token, nx=True, ex=LOCK_TTL_S):
            return None
    except (redis.RedisError, OSError) as exc:
        raise CalibrationError(f"the calibration lock could not be taken (Redis: {type(exc).__name__})") from exc
    try:
        with _measuring:
            row, fresh = stored_costs(key)
            if fresh:  # measured meanwhile (a refresh queued twice)
                return row
            costs = measure(endpoint=endpoint, policy=policy, path=key.path, context=context[:CONTEXT_TOKENS])
            return cost_service.record_calibration(
                endpoint=endpoint,
                draft=policy.draft,
                path=key.path,
                costs=costs,
                repeats=REPEATS,
                context_tokens=min(len(context), CONTEXT_TOKENS),
            )
    finally:
        if client.get(lock) == token.encode():
            client.delete(lock)


def measure(*, endpoint: Endpoint, policy: SpeculationPolicy, path: str, context: list[int]) -> StepCosts:
    """Time the three costs now; the server step and verify(n) borrowed from a fresh calibration of another
    draft on the same endpoint, node class and path when there is one (where prod batches, or runs a model's chain
    single-stream on the local path, verify(n) is timed with the draft step in the same steps: always its own)."""
    batched = batched_path(policy=policy, path=path)
    shared = cost_selectors.newest_calibration(
        endpoint_id=endpoint.pk,
        node_class=endpoint.node_class,
        path=path,
        draft_id=cost_selectors.ANY_DRAFT,
        max_age_s=settings.COST_REFRESH_S,
    )
    if batched:
        draft_step, verify = _batch_step_costs(endpoint=endpoint, policy=policy, context=context)
        target_step = shared.step_costs().target_step_s if shared is not None else _server_step(endpoint, context)
        return StepCosts(target_step_s=target_step, draft_step_s=draft_step, verify_s=verify)
    local = path == VerificationPath.LOCAL
    stepped = _single_step_costs(endpoint=endpoint, policy=policy, context=context) if local else None
    if stepped is not None:
        target_step = shared.step_costs().target_step_s if shared is not None else _server_step(endpoint, context)
        return StepCosts(target_step_s=target_step, draft_step_s=stepped[0], verify_s=stepped[1])
    proposer = _draft_proposer(policy)
    draft_step = min(_quietly(endpoint, lambda: time_draft_step(proposer, context, repeats=1), quiet=local))
    if shared is not None:
        borrowed = shared.step_costs()
        return StepCosts(target_step_s=borrowed.target_step_s, draft_step_s=draft_step, verify_s=borrowed.verify_s)
    _yield_point()
    return StepCosts(
        target_step_s=_server_step(endpoint, context),
        draft_step_s=draft_step,
        verify_s=_verify_costs(endpoint=endpoint, policy=policy, path=path, context=context),
    )


def _batch_step_costs(
    *, endpoint: Endpoint, policy: SpeculationPolicy, context: list[int]
) -> tuple[float, dict[int, float]]:
    """The draft step and verify(n) where prod runs the policy in the worker's batch loop: steps of a batch decoder
    at each size, timed as the decoder times them (speculation.worker.step_timing.BatchStepTimer) in the batch
    loop's own thread (batching.on_loop_thread says why), the median of the rounds per size, each round after the
    server has gone quiet, and each step's tokens relayed beside the next step as a request thread relays them
    (speculation.worker.step_timing.StepRelay): the steps run where and as prod's do, so their typical time is what
    prod's requests pay (the fastest repeat, or no relay, projects prod faster than it runs: docs/BENCHMARKS.md).
    With n-gram lookup the timer drafts with the target itself (verify(n) does not depend on what proposed the
    drafts) and the lookup is timed on its own."""
    from speculation.worker import batching

    loaded = resources.model(policy.target_path)
    target = loaded.model
    ngram = policy.mechanism in LOOKUP_KINDS or policy.draft is None
    drafter = loaded if ngram else resources.model(policy.draft.path)
    draft, shared = drafter.model, resources.shared_vocab(drafter, target.vocab_size)
    timers: list[BatchStepTimer] = []
    client = _redis()
    relay = StepRelay(loaded.tokenizer, client=client)  # the request thread's part of each step, as in prod

    def one_round() -> tuple[dict[int, float], list[float]]:  # in the batch loop's thread, as prod's steps run
        if not timers:
            timers.append(BatchStepTimer(target, draft=draft, context=context, relay=relay.put, shared_vocab=shared))
        return timers[0].round(VERIFY_SIZES)

    try:
        rounds = _quietly(endpoint, lambda: batching.on_loop_thread(one_round), quiet=True)
    except ValueError as exc:
        raise CalibrationError(f"timing the batch loop's steps: {exc}") from exc
    finally:
        relay.close()
        client.close()
    timed = {n: [r[0][n] for r in rounds if n in r[0]] for n in VERIFY_SIZES}
    verify = non_decreasing({n: statistics.median(values) for n, values in timed.items() if values})
    if not verify:
        raise CalibrationError("no batch step of the sizes timed ran in full")
    if ngram:
        draft_step = min(_quietly(endpoint, lambda: time_draft_step(NgramProposer(), context, repeats=1), quiet=True))
    else:
        samples = [seconds for r in rounds for seconds in r[1]]
        if not samples:
            raise CalibrationError("no batch step drafted its K in full")
        draft_step = statistics.median(samples)
    return draft_step, verify


def _single_step_costs(
    *, endpoint: Endpoint, policy: SpeculationPolicy, context: list[int]
) -> tuple[float, dict[int, float]] | None:
    """The draft step and verify(n) where prod runs a model's chain drafts single-stream on the local path (an EAGLE
    head, a model transformers runs): steps of the engine's loop with prod's own proposer and target
    (speculation.worker.step_timing.SingleStepTimer) in this thread, at prod's single-stream torch threads (the
    task's thread and prod's request threads alike: speculation.worker.openmp.side_thread), the median of the rounds
    per size, each round after the server has gone quiet, each step's tokens relayed before the next as prod's
    request thread relays them (StepRelay): the fastest repeat of the forwards alone projected prod's step 1.4-1.7x
    faster than it ran (docs/BENCHMARKS.md, bench_traffic_loop). None for lookups and draft trees (their forwards
    are timed alone)."""
    mechanism = drafting.for_kind(policy.mechanism)
    if policy.draft is None or not mechanism.model_steps or (mechanism.drafts_trees and policy.eagle_tree):
        return None
    loaded = resources.model(policy.target_path)
    try:
        proposer = mechanism.proposer(policy, loaded).proposer  # prod's own (build)
    except PathUnavailable as exc:
        raise CalibrationError(str(exc)) from exc
    client = _redis()
    relay = StepRelay(loaded.tokenizer, client=client)
    timer = SingleStepTimer(LocalTarget(loaded.model), proposer, context=context, relay=waited(relay))
    try:
        rounds = _quietly(endpoint, lambda: timer.round(VERIFY_SIZES), quiet=True)
    finally:
        relay.close()
        client.close()
    timed = {n: [seconds for r in rounds for seconds in r[0].get(n, [])] for n in VERIFY_SIZES}
    verify = non_decreasing({n: statistics.median(values) for n, values in timed.items() if values})
    drafts = [seconds for r in rounds for seconds in r[1]]
    if not verify or not drafts:
        raise CalibrationError("no single-stream step of the sizes timed ran in full")
    return statistics.median(drafts), verify


def batched_path(*, policy: SpeculationPolicy, path: str) -> bool:
    """Whether prod runs this policy in the worker's batch loop (speculation.worker.batching.serves): the local
    path with a draft model, a lookup or the hybrid of both while batching is on. Its costs are then timed on the
    batch engine (the hybrid's: its draft model's steps; its lookups cost next to nothing)."""
    from speculation.worker import batching

    local = path == VerificationPath.LOCAL and bool(policy.target_path)
    if not (local and batching.enabled() and policy.mechanism in drafting.BATCHED_KINDS):
        return False
    # a model transformers runs for ACE (implementation "generic") is served at batch one (batching.serves, which
    # reads the loaded models; here their config.json files, without loading them)
    draft_native = policy.draft is None or policy.draft.kind != Mechanism.DRAFT_MODEL
    draft_native = draft_native or _implementation(policy.draft.path) == "native"
    return draft_native and _implementation(policy.target_path) == "native"


def _implementation(directory: str) -> str:
    """How the engine runs the model in `directory` (speculation.engine.families), from its config.json."""
    try:
        model_type = json.loads((Path(directory) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return "native"  # unreadable: loading it will say why
    return implementation_of(model_type)


def _draft_proposer(policy: SpeculationPolicy) -> Any:
    """The policy's drafting as prod's single-stream loop runs it, for timing a draft step (a lookup, or a policy
    naming no draft: n-gram lookup, the lookup kinds' shared calibration)."""
    try:
        return drafting.for_kind(policy.mechanism).timing_proposer(policy)
    except PathUnavailable as exc:
        raise CalibrationError(str(exc)) from exc


class Preempted(Exception):
    """Foreground jobs wait on the node class's queue: a background calibration stops between two timings (and its
    task queues it again), so a worker process running one never holds prod or shadow jobs for minutes."""


_preemption = threading.local()


@contextmanager
def preemptible(foreground_waiting: Callable[[], bool]) -> Iterator[None]:
    """Within it, each timing first asks `foreground_waiting` and raises Preempted when it says yes."""
    _preemption.check = foreground_waiting
    try:
        yield
    finally:
        _preemption.check = None


def _yield_point() -> None:
    check = getattr(_preemption, "check", None)
    if check is not None and check():
        raise Preempted("prod or shadow jobs wait on the node class's queue")


def _quietly(endpoint: Endpoint, timing: Callable[[], Any], *, quiet: bool, rounds: int = REPEATS) -> list[Any]:
    """`timing` (one repeat) run `rounds` times; with quiet, each after waiting until the server serves nothing, for
    at most QUIET_WAIT_S in all (a server that stays busy does not hold the worker's process for long). The worker's
    own costs on the local path are what prod pays once the worker serves the traffic itself and the server no
    longer does; on a node the two share, timings taken while the server serves shadow's traffic carry the server's
    work too (measured: 8-10x prod's own steps at load 7-20, docs/BENCHMARKS.md). Quiet also waits for the node's
    cores (speculation.worker.cpuload): vLLM's CPU build spins a core for about a second after its gauge reads 0."""
    results, deadline = [], (time.monotonic() + QUIET_WAIT_S if quiet else 0.0)
    for _ in range(rounds):
        _yield_point()
        if quiet:
            _wait_until_server_idle(endpoint, deadline=deadline)
            cpuload.wait_until_quiet(deadline=deadline, cores=_quiet_cores())
        results.append(timing())
    return results


def _quiet_cores() -> float:
    """Other processes' CPU below which the node counts as quiet: QUIET_CPU_SHARE of its cores, at least 0.5."""
    return max(0.5, QUIET_CPU_SHARE * (os.cpu_count() or 1))


def _wait_until_server_idle(endpoint: Endpoint, *, deadline: float) -> bool:
    """Poll the server's running + waiting requests (its kind's wire format) until 0 or the deadline; False when it
    stayed busy or cannot say (the timing then runs anyway)."""
    wire = wire_for(endpoint.kind)
    while True:
        try:
            request = wire.in_flight()
            url = endpoint.base_url.rstrip("/") + request.path
            response = upstream.http().request(request.method, url, headers=upstream.headers(endpoint), timeout=2)
            busy = wire.parse_in_flight(response.text) if response.status_code == 200 else 0.0
        except Exception:  # noqa: BLE001 - a kind without the gauge, the server unreachable: time anyway
            return False
        if busy <= 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(QUIET_POLL_S)


def _server_step(endpoint: Endpoint, context: list[int]) -> float:
    client, headers = upstream.http(), upstream.headers(endpoint)
    return server_step_seconds(client=client, endpoint=endpoint, headers=headers, prompt_ids=context)


def _verify_costs(*, endpoint: Endpoint, policy: SpeculationPolicy, path: str, context: list[int]) -> dict[int, float]:
    """verify(n) on prod's single-stream path: the target in this worker, or prod's RemoteTarget over the server's
    scoring call."""
    if path == VerificationPath.LOCAL:
        target = LocalTarget(resources.model(policy.target_path).model)
        rounds = _quietly(endpoint, lambda: time_verify(target, context, VERIFY_SIZES, repeats=1), quiet=True)
        return non_decreasing({n: min(r[n] for r in rounds) for n in rounds[0]})
    from speculation.worker.generation import PathUnavailable, build

    try:
        target = build(endpoint, policy, VerificationPath.REMOTE).remote  # prod's own RemoteTarget
    except PathUnavailable as exc:
        raise CalibrationError(f"the remote path cannot run this policy: {exc}") from exc
    try:
        return time_verify(target, context, VERIFY_SIZES, repeats=REPEATS)
    except (httpx.HTTPError, WireError, Unsupported, RemoteVerificationError) as exc:
        raise CalibrationError(f"timing the server's scoring call failed: {type(exc).__name__}: {exc}") from exc


def server_step_seconds(
    *, client: httpx.Client, endpoint: Endpoint, headers: dict[str, str], prompt_ids: list[int]
) -> float:
    """Median over SERVER_REPEATS of (T(1 + N) - T(1)) / N for a plain greedy generation of N extra tokens."""
    wire = wire_for(endpoint.kind)

    def timed(tokens: int) -> float:
        request = wire.baseline(model=endpoint.served_model, prompt=prompt_ids, max_tokens=tokens)
        started = time.perf_counter()
        response = client.request(
            request.method,
            endpoint.base_url.rstrip("/") + request.path,
            json=request.json,
            headers=headers,
            timeout=SERVER_TIMEOUT,
        )
        elapsed = time.perf_counter() - started
        response.raise_for_status()
        produced = wire.parse_baseline(response.json())
        if produced != tokens:
            raise CalibrationError(f"the server generated {produced} tokens where {tokens} were asked")
        return elapsed

    try:
        samples = [(timed(1 + SERVER_STEP_TOKENS) - timed(1)) / SERVER_STEP_TOKENS for _ in range(SERVER_REPEATS)]
    except (httpx.HTTPError, WireError, Unsupported, ValueError) as exc:
        raise CalibrationError(f"timing the server's plain decode step failed: {type(exc).__name__}: {exc}") from exc
    step = statistics.median(samples)
    if step <= 0:
        raise CalibrationError(f"the server's decode step did not separate from its overhead (median {step:.6f} s)")
    return step


def projection(
    *,
    endpoint: Endpoint,
    policy: SpeculationPolicy,
    context: list[int],
    tokens_per_step: float,
    k: float,
    verified: float | None = None,  # drafts one verification checks when not K (a draft tree's nodes)
    stored: tuple[CostCalibration | None, str] | None = None,  # shadow_costs' answer when the caller has it
    draft_steps: float | None = None,  # model steps per verification when not K (a hybrid's lookups cost none)
) -> tuple[float | None, str, float | None]:
    """Shadow's projected multiplier S = E[N] / (v(K) + K c) from the newest stored calibration, how it was made
    (for the record's reason) and the server step (ms) it is over (the record's server_step_ms); None with PENDING
    and the key's tag before the first calibration is stored."""
    try:
        row, note = stored or shadow_costs(endpoint=endpoint, policy=policy, context=context)
    except Exception as exc:  # noqa: BLE001 - the measurement is still recorded, without a projection
        logger.warning("reading the costs of endpoint %s failed: %s", endpoint.pk, exc)
        return None, f"no projection: the costs could not be read ({type(exc).__name__}: {exc})", None
    if row is None:
        key = cost_key(endpoint=endpoint, policy=policy)
        return None, f"{PENDING} [{key.tag}]: projected when the worker has measured c and v ({note})", None
    value = projected(row, tokens_per_step=tokens_per_step, k=k, note=note, verified=verified, draft_steps=draft_steps)
    return (*value, row.target_step_ms)


def prod_server_step_ms(*, endpoint: Endpoint, policy: SpeculationPolicy) -> float | None:
    """The server's plain decode step (ms) prod's multiplier is over: the target step of the newest calibration
    stored for the key shadow projects with (`cost_key`: endpoint, node class, path, the policy's draft), of any
    age (prod never queues one); None before the first (prod's multiplier is then over its end-to-end baseline).

    Why this basis, and not the request's own plain rate: shadow's S = E[N] / (v(K) + K c) divides the worker's
    projected step by this very number, so with prod's multiplier = its decode rate x this step (generation.
    measured_multiplier), shadow / prod = (E[N] shadow / E[N] prod) x (prod's measured worker step / the
    projected one), whatever the server's speed:
    the two differ only by what the cost model gets wrong. A request's own plain rate would not do: prod has no
    plain run of its request, and a rate read from one request's latency carries its prefill, the HTTP round trip
    and the server's load of that moment (the end-to-end baseline, cached 600 s, moved 1.2-51 tok/s between runs
    at load 0.6-20 while the stored step was taken at yet another moment: docs/BENCHMARKS.md). The stored step is
    the server's decode step with those overheads cancelled ((T(1 + N) - T(1)) / N, the median of repeats)."""
    row, _ = stored_costs(cost_key(endpoint=endpoint, policy=policy))
    return row.target_step_ms if row is not None else None


def projected(
    row: CostCalibration,
    *,
    tokens_per_step: float,
    k: float,
    note: str = "",
    verified: float | None = None,
    draft_steps: float | None = None,
) -> tuple[float, str]:
    """S from a stored calibration, with the basis for the record's reason (verified, draft_steps: see
    StepCosts.multiplier)."""
    basis = cost_selectors.projection_basis(row, k=k) + (f"; {note}" if note else "")
    costs = row.step_costs()
    return costs.multiplier(tokens_per_step=tokens_per_step, k=k, verified=verified, draft_steps=draft_steps), basis
