"""Prod generation in the GPU worker: draft + verify on the chosen path, tokens streamed through Redis.

Every path runs the engine's one decode loop (speculation.engine.decode.generate) with an engine proposer
(draft model, EAGLE head or n-gram): the local path verifies on a LocalTarget (the target loaded in this
worker), the remote path on a RemoteTarget (the server's scoring call, speculation.worker.paths.remote).
The request's stop rules (speculation.worker.paths.stopping) are applied token by token inside the loop, so a
step is cut where plain decoding would have stopped and the stats count only what was kept.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import redis
from django.conf import settings

from fleet.adapters import wire_for
from fleet.models import Endpoint
from speculation import drafting
from speculation.drafting.build import PathUnavailable
from speculation.engine import (
    GenerationConfig,
    LocalTarget,
    SamplingParams,
    SpecStats,
    Target,
    TreeLookahead,
    generate,
)
from speculation.engine.projection import StepCosts
from speculation.engine.proposers import loop_k
from speculation.engine.request import truncate_at_stop
from speculation.jobs.admission import Cancelled, JobSlot
from speculation.jobs.channel import Cancelled as CancelledMessage
from speculation.jobs.channel import Done, Error, Ready, WorkerChannel
from speculation.jobs.job import ProdJob
from speculation.models import SpeculationPolicy, VerificationPath
from speculation.openai_fields import is_greedy
from speculation.selectors.autopairing import Choice
from speculation.services import target_identity
from speculation.worker import autopick, baseline, batching, costs, suffix_store, upstream
from speculation.worker.paths import CommittedBatch, resources
from speculation.worker.paths.remote import RemoteTarget
from speculation.worker.paths.stopping import StopMatcher, StopRule
from speculation.worker.paths.text import IncrementalText
from speculation.worker.stats import stage_fields
from speculation.worker.stream import TokenStream

logger = logging.getLogger(__name__)


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=10)


@dataclass
class Prepared:
    """What one prod request runs with on this worker: an engine proposer and the target that verifies."""

    proposer: Any  # an engine proposer (speculation.engine.proposers / eagle)
    tokenizer: Any
    eos_ids: frozenset[int]
    target: LocalTarget | None = None  # local path
    remote: RemoteTarget | None = None  # remote path
    max_logprobs: int = 0  # remote path: the server's max logprobs (a sampled request needs top_k below it)
    costs: StepCosts | None = None  # local path: the stored calibration, where the batch loop starts its K from

    def target_for(self, params: SamplingParams) -> Target:
        """The local target, or the server: a sampled request is scored with its top-N log-probabilities."""
        if self.target is not None:
            return self.target
        assert self.remote is not None
        return self.remote if params.greedy else self.remote.sampled(params.top_k, self.max_logprobs)


def build(endpoint: Endpoint, policy: SpeculationPolicy, path: str) -> Prepared:
    """The engine proposer and target (local or remote), tokenizer and eos ids for this policy on this worker."""
    if path == VerificationPath.LOCAL:
        if not policy.target_path:
            raise PathUnavailable("path local needs the policy's target_path")
        identity = target_identity.check(endpoint=endpoint, target_path=policy.target_path)
        if identity.problem:  # never serve another model's text as the endpoint's
            raise PathUnavailable(identity.problem)
        loaded = resources.model(policy.target_path)
        drafter = drafting.for_kind(policy.mechanism).proposer(policy, loaded)
        prepared = Prepared(drafter.proposer, drafter.tokenizer, drafter.eos_ids, target=LocalTarget(loaded.model))
        if not batching.serves(prepared):  # only the batch loop's controller starts from the stored costs
            return prepared
        row, _ = costs.stored_costs(costs.cost_key(endpoint=endpoint, policy=policy))
        stored = row.step_costs() if row is not None and row.path == VerificationPath.LOCAL else None
        return replace(prepared, costs=stored)
    if path != VerificationPath.REMOTE:
        raise PathUnavailable(f"path {path!r} does not run in the worker")
    drafter = drafting.for_kind(policy.mechanism).proposer(policy, None)
    caps = dict(endpoint.capabilities or {})
    remote = RemoteTarget(
        client=upstream.http(),
        base_url=endpoint.base_url,
        model=endpoint.served_model,
        headers=upstream.headers(endpoint),
        wire=wire_for(endpoint.kind),
        vocab_size=drafter.vocab_size,
        max_context=int(caps.get("max_context") or 1 << 30),
    )
    return Prepared(
        drafter.proposer,
        drafter.tokenizer,
        drafter.eos_ids,
        remote=remote,
        max_logprobs=int(caps.get("max_logprobs") or 0),
    )


SLOT_HOLD_S = settings.PROD_STEP_TIMEOUT_S + 60.0  # a step refreshes the job's slot; a dead worker's expires

GREEDY_JOB = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}


def speculate(
    prepared: Prepared,
    *,
    prompt_ids: list[int],
    max_tokens: int,
    k: int,
    on_tokens: Any = None,
    sampling: dict[str, Any] | None = None,
    stop: StopRule | None = None,
    ends_after: Any = None,
    batch: bool = False,
    lookahead: TreeLookahead | None = None,
) -> SpecStats:
    """Run the prepared path (fixed K; with a lookahead, the controller sizes each draft tree within K) through the
    engine's loop; returns its stats.

    on_tokens gets each verification's committed tokens (the accepted drafts + the target's token, cut where
    the request ends). sampling: temperature / top_k / top_p / seed as the gateway parsed them
    (speculation.gateway.sampling); None = greedy. Sampled requests run the engine's exact rejection sampling.
    stop: the request's stop rule (its stop tokens, min_tokens); None = the model's end tokens. ends_after is
    asked for each committed token whether the request ends after it (a stop string, max_tokens).
    batch: the process's batch loop serves it, with other requests (speculation.worker.batching.serves).
    lookahead: a draft-tree policy's controller (``tree_sizing``), kept across requests.
    """
    stop_ids = stop.stop_ids if stop is not None else prepared.eos_ids
    sampling = {**GREEDY_JOB, **(sampling or {})}
    if not batch:  # the batch loop's decoder applies a hybrid's two caps itself
        k = loop_k(prepared.proposer, k)
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        k=k,
        dynamic_k=lookahead is not None and not batch and k > 0,
        temperature=float(sampling["temperature"]),
        top_k=int(sampling["top_k"]),
        top_p=float(sampling["top_p"]),
        seed=int(sampling["seed"]),
        fixed_k=sampling.get("seeded", True) is not False,  # a job from before "seeded": keep its K
        stop_token_ids=tuple(sorted(stop_ids)),
        min_tokens=stop.min_tokens if stop is not None else 0,
        suppress_ids=tuple(sorted(stop.suppressed_ids)) if stop is not None else (),
    )
    if batch:
        return _batched(prepared, config, prompt_ids, on_tokens, ends_after)
    target = prepared.target_for(config.sampling)
    with batching.single_stream():  # the loaded models' own KV caches
        return generate(
            target,
            prepared.proposer,
            prompt_ids,
            config,
            on_tokens=on_tokens,
            ends_after=ends_after,
            lookahead=lookahead,
        ).stats


_TREE_LOOKAHEADS: dict[tuple, TreeLookahead] = {}  # per endpoint, draft, tree and K: estimates carry over


@dataclass
class TreeSizing:
    """A draft-tree policy with dynamic K on this worker's local path: the lookahead controller that chooses each
    step's tree shape (the chain, the tree with half its nodes, the tree) and depth from measured costs."""

    lookahead: TreeLookahead
    before: dict[str, int]  # the controller's drafting steps per shape before this request

    def reason(self) -> str:
        steps = {label: n - self.before.get(label, 0) for label, n in self.lookahead.used.items()}
        counts = ", ".join(f"{label} {n}" for label, n in steps.items())
        return f"draft tree sized per step by the lookahead controller (drafting steps per shape: {counts})"


def tree_sizing(
    endpoint: Endpoint, policy: SpeculationPolicy, prepared: Prepared, k: int, draft: Any
) -> TreeSizing | None:
    """The controller for a policy with ``dynamic_k`` whose proposer drafts trees in this process; None otherwise
    (a chain, fixed K, the remote path, ACE_PROD_PLAIN). draft: what names the proposer (the candidate or draft)."""
    tree = getattr(prepared.proposer, "tree", None)
    if not policy.dynamic_k or tree is None or prepared.target is None or k < 1 or settings.PROD_PLAIN:
        return None
    key = (endpoint.pk, draft, tree, k)
    if key not in _TREE_LOOKAHEADS:
        _TREE_LOOKAHEADS[key] = TreeLookahead.for_tree(tree, k_max=k, k_start=k)
    lookahead = _TREE_LOOKAHEADS[key]
    return TreeSizing(lookahead, dict(lookahead.used))


def _batched(prepared: Prepared, config: GenerationConfig, prompt_ids: list[int], on_tokens, ends_after) -> SpecStats:
    """The batch loop's steps (speculation.worker.batching), cut and counted as the engine's loop does."""
    stats = SpecStats()

    def is_stop(token: int) -> bool:
        return bool(ends_after(token)) if ends_after is not None else False

    def emit(step: CommittedBatch) -> bool:
        new, accepted, reached, stopped = truncate_at_stop(step.ids, step.accepted, step.drafted, is_stop)
        stats.record_step(drafted=step.drafted, accepted=accepted, reached=reached, looked_up=step.looked_up)
        stats.output_tokens += len(new)
        if on_tokens is not None:
            on_tokens(new)
        return stopped

    batching.speculate(prepared, config=config, prompt_ids=prompt_ids, emit=emit)
    return stats


def _baseline(client: redis.Redis, endpoint: Endpoint, job: ProdJob) -> float | None:
    return baseline.baseline_tok_s(
        redis_client=client,
        endpoint_id=endpoint.pk,
        measure=lambda: baseline.calibrate(
            client=upstream.http(),
            base_url=endpoint.base_url,
            kind=endpoint.kind,
            model=endpoint.served_model,
            headers=upstream.headers(endpoint),
            prompt_ids=job.prompt_ids,
            max_tokens=job.max_tokens,
        ),
    )


def _prepare(endpoint: Endpoint, policy: SpeculationPolicy, job: ProdJob) -> tuple[Prepared, int, Choice | None]:
    """The proposer and target this request runs with, its K, and (`draft: auto`) the choice behind them: the
    workload's best candidate and K where the evidence says so (speculation.worker.autopick); a chosen candidate
    that cannot load here leaves the request to the policy's own draft, with the reason."""
    if not policy.auto_pairing or job.path not in autopick.KINDS_ON_PATH:
        return build(endpoint, policy, job.path), job.k, None
    chosen, choice = autopick.choose(endpoint=endpoint, policy=policy, workload=job.workload, path=job.path, k=job.k)
    if chosen is policy:
        return build(endpoint, policy, job.path), choice.k, choice
    try:
        return build(endpoint, chosen, job.path), choice.k, choice
    except PathUnavailable as exc:
        logger.warning("request %s: auto choice %s not usable: %s", job.request_id, choice.candidate, exc)
        own = autopick.policy_choice(policy, job.k)
        reason = f"auto: {choice.candidate} could not run here ({exc}): the policy's {own.candidate} K={own.k}"
        return build(endpoint, policy, job.path), own.k, replace(own, reason=reason)


def measured_multiplier(
    *, tok_s: float | None, decode_tok_s: float | None, server_step_ms: float | None, baseline_tok_s: float | None
) -> float | None:
    """Prod's multiplier: its decode rate over the server's plain decode rate 1 / server step, the stored step
    shadow's projection is over too (speculation.worker.costs.prod_server_step_ms says why). Both sides are read
    the same way: the server step is (T(1 + N) - T(1)) / N, so the server's prefill and first token are not in
    it, and prod's decode rate is the tokens after its first step over the time after it (TokenStream), so the
    worker's prefill of the prompt (target and draft) is not in it either. Over the end-to-end baseline (tok/s
    over baseline_tok_s, both end to end) only while no calibration is stored: the record's server_step_ms is
    then null."""
    if server_step_ms and (decode_tok_s or tok_s):
        return (decode_tok_s or tok_s) * server_step_ms / 1000.0
    return tok_s / baseline_tok_s if tok_s and baseline_tok_s else None


def _generate(job: ProdJob, client: redis.Redis, stream: TokenStream) -> None:
    """Load, calibrate, generate through the stream and send the done message with the record's fields."""
    endpoint = Endpoint.objects.get(pk=job.endpoint_id)
    policy = SpeculationPolicy.objects.select_related("draft").get(endpoint=endpoint)
    prepared, k, choice = _prepare(endpoint, policy, job)
    sizing = tree_sizing(endpoint, policy, prepared, k, choice.candidate if choice else policy.draft_id)
    base = _baseline(client, endpoint, job)  # end to end: kept beside the multiplier (the dashboard's baseline)
    server_step_ms = costs.prod_server_step_ms(endpoint=endpoint, policy=policy)
    stream.channel.send(Ready(), slot=stream.slot)  # loaded and calibrated: the step timeout applies
    rule = StopRule.from_fields(
        job.stop,
        max_tokens=job.max_tokens,
        eos_token_id=prepared.tokenizer.eos_token_id,
        eos_ids=prepared.eos_ids,
    )
    matcher = stream.matcher = StopMatcher(rule, decode=IncrementalText(prepared.tokenizer).add)
    started = time.perf_counter()
    stats = speculate(
        prepared,
        prompt_ids=job.prompt_ids,
        max_tokens=job.max_tokens,
        k=0 if settings.PROD_PLAIN else k,  # ACE_PROD_PLAIN: the same path at K = 0 (benchmarks)
        on_tokens=stream.send,
        sampling=job.sampling,
        stop=rule,
        ends_after=stream.ends_after,
        batch=batching.serves(prepared),
        lookahead=sizing.lookahead if sizing else None,
    )
    ended = time.perf_counter()
    tok_s = stats.output_tokens / (ended - started) if ended > started else None
    decode_tok_s = stream.decode_tok_s(ended)
    record = {
        **stage_fields(stats, k=k),
        "tok_s": tok_s,
        "decode_tok_s": decode_tok_s,  # the rate the multiplier is over the server step with (not a record field)
        "baseline_tok_s": base,
        "server_step_ms": server_step_ms,
        "multiplier": measured_multiplier(
            tok_s=tok_s, decode_tok_s=decode_tok_s, server_step_ms=server_step_ms, baseline_tok_s=base
        ),
    }
    if choice is not None:  # which candidate and K ran, and why
        record.update(mechanism=choice.kind, reason=choice.reason)
    if sizing is not None:  # which tree shapes ran
        record["reason"] = "; ".join(r for r in (record.get("reason"), sizing.reason()) if r)
    tail = matcher.finish()  # the held-back text; "length" when the loop ended at the context
    done = Done(finish_reason=matcher.finish_reason, stop_reason=matcher.stop_reason, text=tail, stats=record)
    stream.channel.send(done, release=stream.slot)
    suffix_store.remember(endpoint.pk, job.request_id, stream.ids)  # after the answer: what later ones draft from
    if choice is not None and not settings.PROD_PLAIN and is_greedy((job.sampling or {}).get("temperature", 0.0)):
        autopick.record_evidence(
            endpoint_id=endpoint.pk,
            node_class=endpoint.node_class,
            request_id=job.request_id,
            workload=job.workload,
            choice=choice,
            stats=stats,
            k=k,
            path=job.path,
        )


def run_prod_generation(job: ProdJob | dict[str, Any]) -> None:
    """Generate one prod request (a job or its wire form); every outcome ends with a done or error message on the
    channel."""
    job = ProdJob.of(job)
    client = redis_client()
    channel = WorkerChannel(client, job.request_id)
    slot = JobSlot(client, request_id=job.request_id, node_class=job.node_class, hold_s=SLOT_HOLD_S)
    stream = TokenStream(channel, slot)
    try:
        slot.check()  # a job the gateway stopped waiting for never starts
        _generate(job, client, stream)
    except Cancelled:
        logger.info("prod generation %s cancelled after %d tokens", job.request_id, stream.sent)
        channel.send(CancelledMessage(stream.sent), release=slot)
    except PathUnavailable as exc:
        channel.send(Error(str(exc)), release=slot)
    except Exception as exc:  # noqa: BLE001 - the gateway falls back; the reason says what broke
        logger.exception("prod generation %s failed", job.request_id)
        channel.send(Error(f"speculative path failed: {type(exc).__name__}: {exc}"), release=slot)
    finally:
        slot.release()
        client.close()
