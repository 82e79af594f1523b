"""Shadow measurement in the GPU worker: what the policy's draft would have achieved on a served request.

Greedy traffic: the engine's one decode loop replays the request on a ReplayTarget (speculation.engine.replay):
one teacher-forced draft pass over prompt + produced tokens gives the draft's proposal at every position, and
the loop's verification steps with lookahead K give exactly what prod would have accepted (the same stats, the
same record fields: speculation.worker.stats).
Sampled traffic: the expected acceptance sum_x min(p, q) per position with p
and q processed as the request asked (temperature, top-k, top-p): exact from the target's logits when the
worker holds the target, else from the server's top-N log-probabilities (exact when top-k < N, otherwise a
lower bound recorded with the mass it could not see: speculation.engine.acceptance).
The projected multiplier S = E[N] / (v(K) + K c) uses the costs this worker measured on the endpoint's node class
(speculation.worker.costs: the server's decode step, the draft step, a verification of K + 1 tokens on prod's path;
medians of repeated timings, refreshed), the lookahead controller's cost model.
"""

from __future__ import annotations

import logging
from typing import Any

from fleet.models import Endpoint
from speculation.engine import NgramProposer, SamplingParams, draft_greedy_predictions, replay_greedy, replay_proposer
from speculation.models import Action, Mechanism, Mode, SpeculationPolicy
from speculation.services.records import record_stage
from speculation.worker.costs import projection
from speculation.worker.paths import resources
from speculation.worker.stats import stage_fields

logger = logging.getLogger(__name__)


def measure_shadow(
    *,
    endpoint_id: int,
    request_id: str,
    prompt_ids: list[int],
    output_ids: list[int],
    finish_reason: str,
    max_tokens: int | None,
    temperature: float,
    latency_ms: float,
    top_p: float = 1.0,
    top_k: int = 0,
    plain_sampling: bool = True,  # queued by an older gateway: top_p / top_k now say it
    workload: str = "",  # the request's workload key (speculation.workloads.keys)
) -> None:
    endpoint = Endpoint.objects.get(pk=endpoint_id)
    policy = SpeculationPolicy.objects.select_related("draft").get(endpoint=endpoint)
    k = policy.k
    budget = max_tokens or len(output_ids)
    common: dict[str, Any] = {
        "mechanism": policy.mechanism,
        "k": k,
        "output_tokens": len(output_ids),
        "latency_ms": latency_ms,
        "workload": workload,
    }
    baseline_tok_s = len(output_ids) / (latency_ms / 1000.0) if latency_ms > 0 else None
    if temperature >= GREEDY_BELOW:
        _measure_sampled(
            endpoint=endpoint,
            policy=policy,
            request_id=request_id,
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            params=SamplingParams(temperature=temperature, top_k=max(0, int(top_k or 0)), top_p=float(top_p)),
            baseline_tok_s=baseline_tok_s,
            common=common,
        )
        return
    sequence = prompt_ids + output_ids
    if policy.mechanism == Mechanism.NGRAM:
        stats = replay_proposer(NgramProposer(), sequence, k, prompt_len=len(prompt_ids), max_new_tokens=budget)
    else:
        predictions = draft_greedy_predictions(resources.model(policy.draft.path).model, sequence)
        stats = replay_greedy(predictions, sequence, k, prompt_len=len(prompt_ids), max_new_tokens=budget)
    fields = stage_fields(stats, k=k)
    tau = stats.mean_accepted_len or 1.0  # no drafts at all: one token per step, as plain decoding
    k_mean = stats.drafted_tokens / stats.target_passes if stats.target_passes else 0.0
    projected, basis = projection(endpoint=endpoint, policy=policy, context=prompt_ids, tokens_per_step=tau, k=k_mean)
    record_stage(
        endpoint_id=endpoint_id,
        request_id=request_id,
        mode=Mode.SHADOW,
        action=Action.WOULD_SPECULATE,
        reason=f"greedy replay (exact); {basis}",
        baseline_tok_s=baseline_tok_s,
        multiplier=projected,
        tok_s=baseline_tok_s * projected if baseline_tok_s and projected else None,
        **{**common, **fields},
    )
    # every other compatible candidate on the same request, within the endpoint's replay budget (auto-pairing)
    from speculation.worker.candidates import measure_candidates_after_shadow

    measure_candidates_after_shadow(
        endpoint=endpoint,
        policy=policy,
        request_id=request_id,
        workload=workload,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        max_tokens=budget,
    )


SCORING_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature (as speculation.gateway.sampling)


def _target_top_logprobs(endpoint: Endpoint, prompt_ids: list[int], output_ids: list[int]) -> tuple[list, int]:
    """The server's top-N raw log-probabilities at every output position (one scoring call through the server
    kind's wire format), and N. fleet.adapters.Unsupported when the server kind cannot score token ids."""
    from fleet.adapters import wire_for
    from speculation.worker.generation import _headers, http

    wire = wire_for(endpoint.kind)
    top_n = min(SCORING_LOGPROBS, int(endpoint.capabilities.get("max_logprobs") or SCORING_LOGPROBS))
    sequence = prompt_ids + output_ids
    request = wire.score(model=endpoint.served_model, token_ids=sequence, top_n=top_n)
    url = endpoint.base_url.rstrip("/") + request.path
    response = http().request(request.method, url, headers=_headers(endpoint), timeout=120, json=request.json)
    response.raise_for_status()
    scored = wire.parse_score(response.json(), token_ids=sequence, top_n=top_n)
    # only the top-N by rank are a complete head (the output token's own log-probability is kept apart)
    top = [{t.token_id: t.logprob for t in position.top} for position in scored.positions[len(prompt_ids) :]]
    return top, top_n


def _measure_sampled(
    *,
    endpoint: Endpoint,
    policy: SpeculationPolicy,
    request_id: str,
    prompt_ids: list[int],
    output_ids: list[int],
    params: SamplingParams,
    baseline_tok_s: float | None,
    common: dict[str, Any],
) -> None:
    """Expected acceptance sum_x min(p(x), q(x)) per output position, p and q processed as the request asked.

    Exact when the worker holds the target (the policy's target_path): both distributions from teacher-forced
    logits. Otherwise p comes from the server's top-N log-probabilities: exact when 0 < top_k < N, else a lower
    bound, recorded with the mass it could not attribute (speculation.engine.acceptance)."""
    from speculation.engine.acceptance import expected_acceptance_exact, expected_acceptance_from_top
    from speculation.engine.projection import expected_tokens
    from speculation.engine.sampling import probs_from_logits
    from speculation.worker.paths.drafting import teacher_forced_logits

    if policy.mechanism == Mechanism.NGRAM or policy.draft is None:
        record_stage(
            endpoint_id=endpoint.pk,
            request_id=request_id,
            mode=Mode.SHADOW,
            action=Action.WOULD_SPECULATE,
            reason="sampled traffic with n-gram drafts: no draft distribution to compare",
            baseline_tok_s=baseline_tok_s,
            **common,
        )
        return
    draft = resources.model(policy.draft.path)
    q = probs_from_logits(teacher_forced_logits(draft.model, prompt_ids, output_ids), params)  # [n, V]
    unseen_mass: float | None = None
    if policy.target_path:
        target = resources.model(policy.target_path).model
        p = probs_from_logits(teacher_forced_logits(target, prompt_ids, output_ids), params)  # [n, V]
        per_position = expected_acceptance_exact(p, q)
        source = "exact, from the target's logits in the worker"
    else:
        top, top_n = _target_top_logprobs(endpoint, prompt_ids, output_ids)
        per_position, unseen, exact = expected_acceptance_from_top(top, q, params)
        if exact:
            source = f"exact, from the server's top-{top_n} log-probabilities (top_k {params.top_k} < {top_n})"
        else:
            unseen_mass = float(unseen.mean()) if unseen.numel() else 0.0
            source = (
                f"a lower bound from the server's top-{top_n} log-probabilities; "
                f"mean unseen probability mass {unseen_mass:.4f}"
            )
    alpha = float(per_position.mean()) if per_position.numel() else 0.0
    k = policy.k
    tau = expected_tokens(alpha=min(1.0, max(0.0, alpha)), k=k)
    projected, basis = projection(endpoint=endpoint, policy=policy, context=prompt_ids, tokens_per_step=tau, k=k)
    record_stage(
        endpoint_id=endpoint.pk,
        request_id=request_id,
        mode=Mode.SHADOW,
        action=Action.WOULD_SPECULATE,
        reason=f"sampled traffic (temperature {params.temperature:g}, top_k {params.top_k}, top_p "
        f"{params.top_p:g}): expected acceptance sum_x min(p, q) {source}; mean accepted length from the "
        f"i.i.d. formula; {basis}",
        alpha=alpha,
        unseen_mass=unseen_mass,
        acceptance_rate=(tau - 1.0) / k if k else None,
        per_position_acceptance=[alpha ** (j + 1) for j in range(k)],
        mean_accepted_len=tau,
        baseline_tok_s=baseline_tok_s,
        multiplier=projected,
        tok_s=baseline_tok_s * projected if baseline_tok_s and projected else None,
        **common,
    )
