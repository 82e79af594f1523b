"""Every candidate on a shadowed request: full-information feedback at no extra target call.

In shadow the target's output is known, so each candidate compatible with the endpoint is replayed on the same
request at every K in K_RANGE, and one CandidateMeasurement per request x candidate holds, per K, the tokens per
verification step, the projected multiplier (S = E[N] / (v(K) + K c), the shadow projection's cost model with the
candidate's own measured c: speculation.worker.costs), the counts and the per-position acceptance.

The candidates: n-gram prompt lookup, suffix decoding (the endpoint's earlier responses, speculation.worker.
suffix_store, without the request's own), every registered draft model with the endpoint's tokenizer fingerprint,
each of those draft models behind suffix decoding (the hybrid `suffix+NAME`: the store's draft where it has 3 tokens,
else the model's; greedy only, projected with the draft's step charged for the model's drafts only), and, where the
worker holds the target (the policy's target_path), every EAGLE head with that fingerprint trained
for that target (a head drafts from the target's features: one teacher-forced target pass gives them for the whole
request, ReplayTarget hands them to the head; without the target's weights in the worker there are no features, so
EAGLE heads are not candidates on a remote-only policy). With the policy's `eagle_tree` set, a head replays as the
draft tree prod's local path would draft (depth min(depth, K), verified against the known output by
tree.replay_tree_greedy), and its projection counts the verification of every node: S = E[N] / (v(nodes) + depth c).
- Greedy requests: the engine's exact replay (speculation.engine.replay; one teacher-forced pass per draft model or
  target serves all K).
- Sampled requests (temperature > 0):
  - n-gram lookup and suffix decoding: the same replay against the sampled output, exact (a one-hot draft token is
    the step's token exactly when it passed: speculation.engine.replay);
  - a draft model, and the hybrid: the lookup's steps replayed as above, the draft's steps passing position by
    position with the draft's probability of passing given each sampled token, min(1, q(o) / p(o)) with both
    distributions processed as the request asked (speculation.worker.sampled.draft_pass_probabilities: exact where
    the worker holds the target or a server's top-N gives p(o) exactly, else the average sum_x min(p, q), a lower
    bound; the target's side read once for all candidates): the expected counts of
    speculation.engine.replay.expected_hybrid, exact in expectation (the i.i.d. formula over the mean acceptance
    overstated the draft model's tokens per step by 3 % on the demo pair: docs/BENCHMARKS.md);
  - an EAGLE head where the policy drafts a tree (`eagle_tree`): replayed exactly as greedy's, against the sampled
    output (the tree's candidates are the head's top-k, one-hot); a head's sampled chain: in expectation as a draft
    model's, but its j-th draft's probability of passing depends on the step's start (the head drafts from the
    target's features there), so it is read per start and depth (speculation.worker.sampled.eagle_chain_passes: K
    head steps per output position).

Where it runs: speculation.worker.tasks.replay_candidates_task on the node class's background queue, queued by the
shadow measurement (never inside it). Cost stays bounded: an endpoint gets settings.CANDIDATE_REPLAYS_PER_MINUTE
candidate replays (one candidate on one request, every K) per minute, counted in Redis across worker processes.
What the budget sheds is a row with status "shed" and the reason, so the auto-pairing table says how much evidence
was given up; which candidates a request keeps rotates with the request, so shedding does not starve one candidate.
"""

from __future__ import annotations

import copy
import logging
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import redis
from django.conf import settings

from fleet.models import Endpoint
from speculation import drafting
from speculation.engine import (
    HYBRID_LOOKUP_K,
    HYBRID_MIN_LOOKUP,
    SamplingParams,
    SpecStats,
)
from speculation.engine.projection import MAX_PROJECTED_K, StepCosts
from speculation.engine.proposers import LookupProposer
from speculation.engine.replay import (
    expected_hybrid,
)
from speculation.engine.tree import TreeShape
from speculation.jobs import queue
from speculation.limits import tree_nodes_at
from speculation.models import (
    CandidateMeasurement,
    CandidateStatus,
    DraftKind,
    DraftModel,
    SpeculationPolicy,
)
from speculation.selectors import capabilities
from speculation.selectors.drafts import drafts_usable_by
from speculation.services import target_identity
from speculation.worker.costs import current_costs
from speculation.worker.paths import resources

logger = logging.getLogger(__name__)

K_RANGE = tuple(range(1, MAX_PROJECTED_K + 1))
NGRAM, SUFFIX = DraftKind.NGRAM.value, DraftKind.SUFFIX.value  # a lookup candidate is named by its kind
BUDGET_KEY = "ace:candidate-replays:{endpoint_id}:{minute}"


@dataclass(frozen=True)
class Candidate:
    name: str  # "ngram", "suffix" or the draft's name
    kind: str
    draft: DraftModel | None = None


def compatible_candidates(endpoint: Endpoint, *, target_path: str = "") -> list[Candidate]:
    """n-gram lookup and suffix decoding, then every draft model sharing the endpoint's tokenizer fingerprint, each
    of those behind suffix decoding (the hybrid), then (with the target in the worker) every EAGLE head trained for
    that target (by name). Greedy and sampled requests alike."""
    found = [Candidate(NGRAM, DraftKind.NGRAM), Candidate(SUFFIX, DraftKind.SUFFIX)]
    fingerprint = capabilities.tokenizer_fingerprint(endpoint)
    if not fingerprint:
        return found
    same = drafts_usable_by(endpoint).filter(tokenizer_fingerprint=fingerprint).order_by("name")
    models = list(same.filter(kind=DraftKind.DRAFT_MODEL))
    found += [Candidate(d.name, d.kind, d) for d in models]
    hybrid = drafting.for_kind(DraftKind.SUFFIX_DRAFT)
    found += [Candidate(hybrid.candidate_name(d), hybrid.kind, d) for d in models]
    if target_path:
        found += [Candidate(d.name, d.kind, d) for d in same.filter(kind=DraftKind.EAGLE_HEAD) if _fits(d, target_path)]
    return found


def _with_verified_target(endpoint: Endpoint, policy: SpeculationPolicy) -> SpeculationPolicy:
    """The policy as the replays use it: a target_path that does not reproduce the endpoint's model
    (speculation.services.target_identity) is dropped, so no candidate is measured against another model (no EAGLE
    head candidates then, and a sampled request's target side comes from the server)."""
    if not policy.target_path:
        return policy
    problem = target_identity.check(endpoint=endpoint, target_path=policy.target_path).problem
    if not problem:
        return policy
    logger.warning("candidate replays of %s without the local target: %s", endpoint.name, problem)
    unverified = copy.copy(policy)  # never saved
    unverified.target_path = ""
    return unverified


def _fits(head: DraftModel, target_path: str) -> bool:
    """Whether the EAGLE head was trained for the target in target_path (its config names the target's
    fingerprint; a head that cannot be read is no candidate)."""
    try:
        resources.eagle_head(head.path, target_dir=target_path)
    except Exception as exc:  # noqa: BLE001 - EagleHeadError (another target) or an unreadable directory
        logger.info("EAGLE head %s is no candidate for %s: %s", head.name, target_path, exc)
        return False
    return True


def replay(
    candidate: Candidate,
    *,
    prompt_ids: list[int],
    output_ids: list[int],
    max_tokens: int | None,
    target_path: str = "",
    tree: TreeShape | None = None,
    lookup: LookupProposer | None = None,
) -> dict[int, SpecStats]:
    """The candidate's greedy speculation on this request at every K (exact: the engine's replay); an EAGLE head
    drafts the tree `tree` where given (the policy's eagle_tree), else a chain. lookup: what a lookup candidate
    drafts with (suffix decoding: over the endpoint's earlier answers, this request's own left out; default: n-gram
    lookup, or suffix decoding over the request's context only)."""
    sequence = prompt_ids + output_ids
    common: dict[str, Any] = {"prompt_len": len(prompt_ids), "max_new_tokens": max_tokens}
    draft_path = candidate.draft.path if candidate.draft is not None else ""
    return drafting.for_kind(candidate.kind).replay(
        sequence, K_RANGE, draft_path=draft_path, common=common, target_path=target_path, tree=tree, lookup=lookup
    )


def tree_nodes(tree: TreeShape, k: int) -> int:
    """The draft nodes one verification checks when prod drafts this tree at lookahead K (depth min(depth, K))."""
    return tree_nodes_at(tree.top_k, tree.depth, tree.nodes, k)


def take_budget(endpoint_id: int, wanted: int) -> tuple[int, str]:
    """How many of `wanted` candidate replays this endpoint may run now, and why not all."""
    budget = settings.CANDIDATE_REPLAYS_PER_MINUTE
    key = BUDGET_KEY.format(endpoint_id=endpoint_id, minute=int(time.time() // 60))
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
        with client.pipeline() as pipe:
            used = pipe.incrby(key, wanted).expire(key, 120).execute()[0]
    except (redis.RedisError, OSError) as exc:
        return 0, f"the replay budget could not be counted (Redis: {type(exc).__name__})"
    granted = max(0, min(wanted, budget - (used - wanted)))
    return granted, f"over the budget of {budget} candidate replays per minute for this endpoint"


def _costs(endpoint: Endpoint, policy: SpeculationPolicy, candidate: Candidate, context: list[int]) -> StepCosts:
    """The candidate's measured costs on prod's path (its own draft step; the calibration is reused while fresh)."""
    as_policy = SpeculationPolicy(
        endpoint=endpoint,
        mechanism=candidate.kind,
        draft=candidate.draft,
        path=policy.path,
        target_path=policy.target_path,
        resolved_path=policy.resolved_path,
    )
    return current_costs(endpoint=endpoint, policy=as_policy, context=context).step_costs()


def measured_fields(
    per_k: dict[int, SpecStats], costs: StepCosts | None, tree: TreeShape | None = None
) -> dict[str, Any]:
    """The row's per-K lists from the replays (and the projected multiplier where the costs are known; a tree's
    verification covers all its nodes)."""
    mal, mult, counts, positions = [], [], [], []
    for k in K_RANGE:
        stats = per_k[k]
        tau = stats.mean_accepted_len or 1.0  # no drafts at all: one token per step, as plain decoding
        k_mean = stats.drafted_tokens / stats.target_passes if stats.target_passes else 0.0
        verified = k_mean * tree_nodes(tree, k) / min(tree.depth, k) if tree is not None else None
        mal.append(round(tau, 4))
        per_pass = stats.tokens_per_pass  # steps that drafted nothing count (a lookup that found nothing)
        model_steps = stats.model_steps_per_pass  # a hybrid's looked-up drafts cost no draft step
        mult.append(
            round(costs.multiplier(tokens_per_step=per_pass, k=k_mean, verified=verified, draft_steps=model_steps), 4)
            if costs
            else None
        )
        # expected counts (a sampled hybrid's) are floats
        counts.append([round(x, 2) for x in (stats.drafted_tokens, stats.accepted_tokens, stats.target_passes)])
        positions.append([round(a, 4) for a in stats.alpha_per_position])
    return _with_best({"mean_accepted_len": mal, "multiplier": mult, "counts": counts, "per_position": positions})


def _with_best(fields: dict[str, Any]) -> dict[str, Any]:
    known = [(m, k) for k, m in zip(K_RANGE, fields["multiplier"], strict=True) if m is not None]
    best = max(known, key=lambda t: (t[0], -t[1])) if known else None  # the smallest K on a tie
    return {**fields, "best_k": best[1] if best else None, "best_multiplier": best[0] if best else None}


@dataclass
class Replayed:
    """One request under candidate replay: what every candidate is compared on."""

    endpoint: Endpoint
    policy: SpeculationPolicy
    prompt_ids: list[int]
    output_ids: list[int]
    max_tokens: int | None
    params: SamplingParams | None = None  # None: greedy
    request_id: str = ""
    view: Any = None  # speculation.worker.sampled.TargetView, read once for every candidate of a sampled request
    passes: dict[str, Any] = field(default_factory=dict)  # sampled: per draft directory, its probabilities of passing


def measure_candidates(
    *,
    endpoint: Endpoint,
    policy: SpeculationPolicy,
    request_id: str,
    workload: str,
    prompt_ids: list[int],
    output_ids: list[int],
    max_tokens: int | None,
    sampling: dict[str, Any] | None = None,
    budgeted: bool = True,
) -> list[CandidateMeasurement]:
    """Replay every compatible candidate on one request within the budget; one row each (shed ones too).
    sampling: the request's temperature / top_k / top_p (None: greedy). budgeted=False: every candidate (an
    operator's calibration run, not live traffic)."""
    if budgeted and settings.CANDIDATE_REPLAYS_PER_MINUTE <= 0:
        return []
    params = SamplingParams(**sampling) if sampling and float(sampling.get("temperature") or 0) > 0 else None
    policy = _with_verified_target(endpoint, policy)
    request = Replayed(endpoint, policy, prompt_ids, output_ids, max_tokens, params, request_id=request_id)
    candidates = compatible_candidates(endpoint, target_path=policy.target_path or "")
    if not candidates:
        return []
    start = zlib.crc32(request_id.encode()) % len(candidates)  # which ones a partial budget keeps rotates
    candidates = candidates[start:] + candidates[:start]
    granted, shed_reason = take_budget(endpoint.pk, len(candidates)) if budgeted else (len(candidates), "")
    rows = []
    for i, candidate in enumerate(candidates):
        row = CandidateMeasurement(
            endpoint=endpoint,
            request_id=request_id,
            workload=workload,
            candidate=candidate.name,
            kind=candidate.kind,
            draft=candidate.draft,
            output_tokens=len(output_ids),
        )
        if i >= granted:
            row.status, row.reason = CandidateStatus.SHED, shed_reason
        else:
            _fill(row, request, candidate)
        rows.append(row)
    return CandidateMeasurement.objects.bulk_create(rows)


def _fill(row: CandidateMeasurement, request: Replayed, candidate: Candidate) -> None:
    try:
        replayed = _replayed(request, candidate)
    except Exception as exc:  # noqa: BLE001 - one candidate's failure (a missing directory) never stops the rest
        logger.warning("request %s: candidate %s not replayed: %s", row.request_id, candidate.name, exc)
        row.status, row.reason = CandidateStatus.FAILED, f"replay failed: {type(exc).__name__}: {exc}"
        return
    costs = None
    try:
        costs = _costs(request.endpoint, request.policy, candidate, request.prompt_ids)
    except Exception as exc:  # noqa: BLE001 - the acceptance still counts, without a projection
        row.reason = f"no projection: the costs could not be measured ({type(exc).__name__}: {exc})"
    tree = _tree(request, candidate)
    if request.params is None:
        fields, how = measured_fields(replayed, costs, tree), f"greedy replay (exact) at K = 1..{K_RANGE[-1]}"
        how += f" as the policy's draft tree {request.policy.eagle_tree}" if tree is not None else ""
    elif tree is not None:  # an EAGLE head's tree: replayed exactly
        fields = measured_fields(replayed, costs, tree)
        how = f"{sampled_how(request.params)}: the policy's draft tree {request.policy.eagle_tree} {SAMPLED_TREE}"
    elif drafting.for_kind(candidate.kind).reads_target_features:  # an EAGLE head's chain, in expectation
        fields, how = measured_fields(replayed, costs), f"{sampled_how(request.params)}: {SAMPLED_CHAIN}"
    else:  # replayed against the sampled output: a lookup's steps exactly, a draft's in expectation
        fields, parts = measured_fields(replayed, costs), []
        if drafting.for_kind(candidate.kind).lookup_kind:  # a lookup, or the hybrid's
            parts.append(SAMPLED_LOOKUP)
        if candidate.draft is not None:  # a draft model, or the hybrid's
            source = request.passes[candidate.draft.path].source
            parts.append(f"the draft's steps expected from its probability of passing {source}")
        how = f"{sampled_how(request.params)}: " + "; ".join(parts)
    for name, value in fields.items():
        setattr(row, name, value)
    row.reason = f"{how}; c={costs.c:.3f}" if costs is not None else f"{how}; {row.reason}"


SAMPLED_LOOKUP = (
    "the lookup's steps replayed against the sampled output (exact: a one-hot draft token is the step's token "
    "exactly when it passed)"
)


SAMPLED_TREE = (
    "replayed against the sampled output (exact: its candidates are the head's top-k, one-hot, and a child passes "
    "exactly where the token sampled there is that child)"
)


SAMPLED_CHAIN = (
    "the head's chain expected, each draft passing with min(1, q(o) / p(o)) for the sampled token o, q the head's "
    "chain from that step's start after the sampled tokens (exact in expectation)"
)


def sampled_how(params: SamplingParams) -> str:
    return f"sampled (temperature {params.temperature:g}, top_k {params.top_k}, top_p {params.top_p:g})"


def _tree(request: Replayed, candidate: Candidate) -> TreeShape | None:
    """The draft tree a candidate drafts: the policy's eagle_tree for one that reads the target's features (prod
    drafts it with any EAGLE head), else none."""
    mechanism = drafting.for_kind(candidate.kind)
    return TreeShape.from_policy(request.policy.eagle_tree) if mechanism.reads_target_features else None


def _replayed(request: Replayed, candidate: Candidate) -> Any:
    """Greedy, and a lookup on a sampled request: the candidate's replay at every K. Sampled: a draft model's and
    the hybrid's expected replay at every K (speculation.worker.sampled.draft_pass_probabilities)."""
    mechanism = drafting.for_kind(candidate.kind)
    lookup = mechanism.endpoint_lookup(request.endpoint.pk, exclude=request.request_id)
    # one-hot drafts (a lookup's, an EAGLE tree's top-k) pass exactly where the sampled token is theirs
    if request.params is None or mechanism.sampled_exact(_tree(request, candidate)):
        return replay(
            candidate,
            prompt_ids=request.prompt_ids,
            output_ids=request.output_ids,
            max_tokens=request.max_tokens,
            target_path=request.policy.target_path or "",
            tree=_tree(request, candidate),
            lookup=lookup,
        )
    from speculation.worker.sampled import draft_pass_probabilities, target_view

    if request.view is None:  # the target's side once for every candidate (one scoring call at most)
        request.view = target_view(
            endpoint=request.endpoint,
            target_path=request.policy.target_path or "",
            prompt_ids=request.prompt_ids,
            output_ids=request.output_ids,
            params=request.params,
        )
    if mechanism.reads_target_features:  # an EAGLE chain: its passes depend on the step's start
        return expected_chain_replays(
            request.view, candidate.draft.path, target_path=request.policy.target_path or "",
            prompt_ids=request.prompt_ids, output_ids=request.output_ids, max_tokens=request.max_tokens, ks=K_RANGE,
        )  # fmt: skip
    path = candidate.draft.path  # a draft and its hybrid share one teacher-forced pass of the draft
    if path not in request.passes:
        request.passes[path] = draft_pass_probabilities(request.view, path, request.prompt_ids, request.output_ids)
    passes = request.passes[path]
    return expected_hybrid_replays(
        lookup, passes.per_position.tolist(), request.prompt_ids + request.output_ids, K_RANGE,
        prompt_len=len(request.prompt_ids), max_new_tokens=request.max_tokens,
    )  # fmt: skip


def expected_chain_replays(
    view: Any,
    head_path: str,
    *,
    target_path: str,
    prompt_ids: list[int],
    output_ids: list[int],
    max_tokens: int | None,
    ks: tuple[int, ...],
) -> dict[int, SpecStats]:
    """An EAGLE head's sampled chain at each K: expected_hybrid over the chains' probabilities of passing
    (speculation.worker.sampled.eagle_chain_passes; view: the request's TargetView, with the target in the worker)."""
    from speculation.worker.sampled import eagle_chain_passes

    if not target_path:
        raise ValueError("an EAGLE head reads the target's features: the worker needs the target (target_path)")
    chains = eagle_chain_passes(view, head_path, target_path, prompt_ids, output_ids, max(ks))
    sequence, n = prompt_ids + output_ids, len(output_ids)
    return {
        k: expected_hybrid(
            None,
            [0.0] * n,
            sequence,
            k,
            prompt_len=len(prompt_ids),
            lookup_k=k,
            min_lookup=1,
            max_new_tokens=max_tokens,
            chains=chains,
        )  # fmt: skip
        for k in ks
    }


def expected_hybrid_replays(
    lookup: LookupProposer | None,
    passes: list[float],
    sequence: list[int],
    ks: tuple[int, ...],
    *,
    prompt_len: int,
    max_new_tokens: int | None,
) -> dict[int, SpecStats]:
    """The hybrid (lookup None: the draft model alone) on a sampled request at each K (the draft's K):
    speculation.engine.replay.expected_hybrid with the lookup over the endpoint's earlier answers and the draft's
    probability of passing at each position."""
    looked = (lambda n, d: lookup.lookup(sequence[:n], d)) if lookup is not None else None
    return {
        k: expected_hybrid(
            looked,
            passes,
            sequence,
            k,
            prompt_len=prompt_len,
            lookup_k=max(k, HYBRID_LOOKUP_K) if lookup is not None else k,
            min_lookup=HYBRID_MIN_LOOKUP,
            max_new_tokens=max_new_tokens,
        )
        for k in ks
    }


AUTO_CHECK_KEY = "ace:auto-pairing-checked:{endpoint_id}"
AUTO_CHECK_S = 60  # a `draft: auto` endpoint's winner is re-evaluated at most once a minute (any worker)


def maybe_auto_apply(endpoint: Endpoint, policy: SpeculationPolicy) -> None:
    """For a `draft: auto` policy, let auto-pairing switch the draft and K (speculation.services.autopairing)."""
    if not policy.auto_pairing:
        return
    try:
        client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
        if not client.set(AUTO_CHECK_KEY.format(endpoint_id=endpoint.pk), 1, nx=True, ex=AUTO_CHECK_S):
            return  # evaluated within the last minute
    except (redis.RedisError, OSError):
        return
    from speculation.services.autopairing import auto_apply

    auto_apply(endpoint=endpoint)


def request_candidates(*, endpoint: Endpoint, **job: Any) -> None:
    """shadow's hook: queue the candidate replays of one measured request on the node class's background queue
    (speculation.worker.tasks.replay_candidates_task); never fails the request's own measurement."""
    if settings.CANDIDATE_REPLAYS_PER_MINUTE <= 0:
        return
    try:
        queue.enqueue_candidates(node_class=endpoint.node_class, endpoint_id=endpoint.pk, **job)
    except Exception as exc:  # noqa: BLE001 - the broker down: the stage record is already written
        logger.warning("request %s: candidate replays not queued: %s", job.get("request_id"), exc)


def replay_candidates_for_request(*, endpoint_id: int, **job: Any) -> None:
    """The background task's body: every candidate on one request within the budget, then auto-pairing."""
    endpoint = Endpoint.objects.filter(pk=endpoint_id).first()
    policy = SpeculationPolicy.objects.select_related("draft").filter(endpoint_id=endpoint_id).first()
    if endpoint is None or policy is None:
        return  # deleted meanwhile
    try:
        rows = measure_candidates(endpoint=endpoint, policy=policy, **job)
        if rows:
            logger.info("request %s: %d candidate rows", job.get("request_id"), len(rows))
            maybe_auto_apply(endpoint, policy)
    except Exception:  # noqa: BLE001 - logged with the request id; the stage record is already written
        logger.exception("request %s: candidate replays or auto-pairing failed", job.get("request_id"))
