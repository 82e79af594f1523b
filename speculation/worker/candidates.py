"""Every candidate on a shadowed request: full-information feedback at no extra target call.

In shadow the target's output is known, so each candidate compatible with the endpoint (n-gram prompt lookup, and
every registered draft model with the endpoint's tokenizer fingerprint) is replayed on the same request at every
K in K_RANGE with the engine's greedy replay (speculation.engine.replay: exact for greedy traffic; one
teacher-forced pass per draft model serves all K). One CandidateMeasurement per request x candidate holds, per K,
the tokens per verification step, the projected multiplier (S = E[N] / (v(K) + K c), the shadow projection's cost
model with the candidate's own measured c: speculation.worker.costs), the counts and the per-position acceptance.

Not replayed here: EAGLE heads (they read the target's hidden states, so the target must be loaded in the worker)
and sampled traffic (its acceptance is an expectation over both distributions; shadow's own record covers the
policy's draft).

Cost stays bounded: an endpoint gets settings.CANDIDATE_REPLAYS_PER_MINUTE candidate replays (one candidate on one
request, every K) per minute, counted in Redis across worker processes. What the budget sheds is a row with status
"shed" and the reason, so the auto-pairing table says how much evidence was given up; which candidates a request
keeps rotates with the request, so shedding does not starve one candidate.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass
from typing import Any

import redis
from django.conf import settings

from fleet.models import Endpoint
from speculation.engine import NgramProposer, SpecStats
from speculation.engine.projection import MAX_PROJECTED_K, StepCosts
from speculation.engine.replay import draft_greedy_predictions, replay_greedy, replay_proposals
from speculation.models import CandidateMeasurement, CandidateStatus, DraftKind, DraftModel, SpeculationPolicy
from speculation.selectors import capabilities
from speculation.worker.costs import current_costs
from speculation.worker.paths import resources

logger = logging.getLogger(__name__)

K_RANGE = tuple(range(1, MAX_PROJECTED_K + 1))
NGRAM = "ngram"
BUDGET_KEY = "ace:candidate-replays:{endpoint_id}:{minute}"


@dataclass(frozen=True)
class Candidate:
    name: str  # "ngram" or the draft's name
    kind: str
    draft: DraftModel | None = None


def compatible_candidates(endpoint: Endpoint) -> list[Candidate]:
    """n-gram lookup, then every draft model sharing the endpoint's tokenizer fingerprint (by name)."""
    found = [Candidate(NGRAM, DraftKind.NGRAM)]
    fingerprint = capabilities.tokenizer_fingerprint(endpoint)
    if fingerprint:
        drafts = DraftModel.objects.filter(kind=DraftKind.DRAFT_MODEL, tokenizer_fingerprint=fingerprint)
        found += [Candidate(d.name, d.kind, d) for d in drafts.order_by("name")]
    return found


def replay(
    candidate: Candidate, *, prompt_ids: list[int], output_ids: list[int], max_tokens: int | None
) -> dict[int, SpecStats]:
    """The candidate's greedy speculation on this request at every K (exact: the engine's replay)."""
    sequence = prompt_ids + output_ids
    common: dict[str, Any] = {"prompt_len": len(prompt_ids), "max_new_tokens": max_tokens}
    if candidate.kind == DraftKind.NGRAM:
        lookup = NgramProposer()

        def propose(n: int, drafted: int) -> list[int]:
            return lookup.lookup(sequence[:n], drafted)

        return {k: replay_proposals(propose, sequence, k, **common) for k in K_RANGE}
    model = resources.model(candidate.draft.path).model
    predictions = draft_greedy_predictions(model, sequence)  # one teacher-forced pass serves every K
    return {k: replay_greedy(predictions, sequence, k, **common) for k in K_RANGE}


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


def measured_fields(per_k: dict[int, SpecStats], costs: StepCosts | None) -> dict[str, Any]:
    """The row's per-K lists from the replays (and the projected multiplier where the costs are known)."""
    mal, mult, counts, positions = [], [], [], []
    for k in K_RANGE:
        stats = per_k[k]
        tau = stats.mean_accepted_len or 1.0  # no drafts at all: one token per step, as plain decoding
        k_mean = stats.drafted_tokens / stats.target_passes if stats.target_passes else 0.0
        mal.append(round(tau, 4))
        mult.append(round(costs.multiplier(tokens_per_step=tau, k=k_mean), 4) if costs is not None else None)
        counts.append([stats.drafted_tokens, stats.accepted_tokens, stats.target_passes])
        positions.append([round(a, 4) for a in stats.alpha_per_position])
    known = [(m, k) for k, m in zip(K_RANGE, mult, strict=True) if m is not None]
    best = max(known, key=lambda t: (t[0], -t[1])) if known else None  # the smallest K on a tie
    return {
        "mean_accepted_len": mal,
        "multiplier": mult,
        "counts": counts,
        "per_position": positions,
        "best_k": best[1] if best else None,
        "best_multiplier": best[0] if best else None,
    }


def measure_candidates(
    *,
    endpoint: Endpoint,
    policy: SpeculationPolicy,
    request_id: str,
    workload: str,
    prompt_ids: list[int],
    output_ids: list[int],
    max_tokens: int | None,
    budgeted: bool = True,
) -> list[CandidateMeasurement]:
    """Replay every compatible candidate on one greedy request within the budget; one row each (shed ones too).
    budgeted=False: every candidate (an operator's calibration run, not live traffic)."""
    if budgeted and settings.CANDIDATE_REPLAYS_PER_MINUTE <= 0:
        return []
    candidates = compatible_candidates(endpoint)
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
            _fill(row, endpoint, policy, candidate, prompt_ids, output_ids, max_tokens)
        rows.append(row)
    return CandidateMeasurement.objects.bulk_create(rows)


def _fill(
    row: CandidateMeasurement,
    endpoint: Endpoint,
    policy: SpeculationPolicy,
    candidate: Candidate,
    prompt_ids: list[int],
    output_ids: list[int],
    max_tokens: int | None,
) -> None:
    try:
        per_k = replay(candidate, prompt_ids=prompt_ids, output_ids=output_ids, max_tokens=max_tokens)
    except Exception as exc:  # noqa: BLE001 - one candidate's failure (a missing directory) never stops the rest
        logger.warning("request %s: candidate %s not replayed: %s", row.request_id, candidate.name, exc)
        row.status, row.reason = CandidateStatus.FAILED, f"replay failed: {type(exc).__name__}: {exc}"
        return
    costs = None
    try:
        costs = _costs(endpoint, policy, candidate, prompt_ids)
    except Exception as exc:  # noqa: BLE001 - the acceptance still counts, without a projection
        row.reason = f"no projection: the costs could not be measured ({type(exc).__name__}: {exc})"
    for name, value in measured_fields(per_k, costs).items():
        setattr(row, name, value)
    if costs is not None:
        row.reason = f"greedy replay (exact) at K = 1..{K_RANGE[-1]}; c={costs.c:.3f}"


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


def measure_candidates_after_shadow(**kwargs: Any) -> None:
    """shadow's hook: never lets a candidate replay (or auto-pairing) fail the request's own measurement."""
    try:
        rows = measure_candidates(**kwargs)
        if rows:
            logger.info("request %s: %d candidate rows", kwargs.get("request_id"), len(rows))
            maybe_auto_apply(kwargs["endpoint"], kwargs["policy"])
    except Exception:  # noqa: BLE001 - logged with the request id; the stage record is already written
        logger.exception("request %s: candidate replays or auto-pairing failed", kwargs.get("request_id"))
