"""Shadow measurement in the GPU worker: what the policy's draft would have achieved on a served request.

Greedy traffic: the engine's one decode loop replays the request on a ReplayTarget (speculation.engine.replay):
one teacher-forced draft pass over prompt + produced tokens gives the draft's proposal at every position, and
the loop's verification steps with lookahead K give exactly what prod would have accepted (the same stats, the
same record fields: speculation.worker.stats).
Sampled traffic: n-gram lookup and suffix decoding replay as greedy's, against the sampled output (exact: a one-hot
draft token is the step's token exactly when it passed); a draft model, and the hybrid (its lookup's steps as a
lookup's): the draft's steps expected from its probability of passing given each sampled token o, min(1, q(o)/p(o))
with p and q processed as the request asked (speculation.engine.replay.expected_hybrid, exact in expectation;
speculation.worker.sampled: p exact where the worker holds the target, else from the server's top-N
log-probabilities, a lower bound recorded with the mass it could not see; counts rounded to whole tokens on the
record, alpha the mean sum_x min(p, q)); an EAGLE head: its draft tree exactly (one-hot candidates), its chain in
expectation with the probabilities of passing read per step start and depth.
The projected multiplier S = E[N] / (v(K) + K c) uses the costs a worker measured on the endpoint's node class
(speculation.worker.costs: the server's decode step, the draft step, a verification of K + 1 tokens on prod's path),
the lookahead controller's cost model. The measurement stays cheap: calibrations and the other candidates' replays
(auto-pairing) are queued on the node class's background queue, never run here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from fleet.models import Endpoint
from speculation import drafting
from speculation.engine import (
    SamplingParams,
    draft_greedy_predictions,
    replay_greedy,
    replay_proposer,
)
from speculation.engine.lookahead import PRIOR_ALPHA, PRIOR_WEIGHT, ModeledLookahead
from speculation.engine.tree import TreeShape
from speculation.models import Action, Mode, SpeculationPolicy
from speculation.openai_fields import is_greedy
from speculation.selectors.costs import projection_basis
from speculation.services.costs import TREE_REPLAY
from speculation.services.records import record_stage
from speculation.worker import suffix_store
from speculation.worker.candidates import (
    SAMPLED_CHAIN,
    SAMPLED_LOOKUP,
    expected_chain_replays,
    expected_hybrid_replays,
    sampled_how,
    tree_nodes,
)
from speculation.worker.costs import batched_path, projected_path, projection, shadow_costs
from speculation.worker.paths import resources
from speculation.worker.sampled import draft_pass_probabilities, target_view
from speculation.worker.stats import stage_fields

logger = logging.getLogger(__name__)


@dataclass
class Shadowed:
    """One served request under measurement, and what every record of it carries."""

    endpoint: Endpoint
    policy: SpeculationPolicy
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    budget: int
    baseline_tok_s: float | None
    common: dict[str, Any] = field(default_factory=dict)
    server_step_ms: float | None = None  # the stored server step the last projection was over
    _costs: Any = None  # shadow_costs' (calibration or None, note), read once by controller()

    def record(self, *, reason: str, multiplier: float | None = None, **fields: Any) -> None:
        tok_s = self.baseline_tok_s * multiplier if self.baseline_tok_s and multiplier else None
        fields.setdefault("server_step_ms", self.server_step_ms if multiplier else None)
        record_stage(
            endpoint_id=self.endpoint.pk,
            request_id=self.request_id,
            mode=Mode.SHADOW,
            action=Action.WOULD_SPECULATE,
            reason=reason,
            baseline_tok_s=self.baseline_tok_s,
            multiplier=multiplier,
            tok_s=tok_s,
            **{**self.common, **fields},
        )

    def project(
        self, *, tokens_per_step: float, k: float, verified: float | None = None, draft_steps: float | None = None
    ) -> tuple[float | None, str]:
        value, basis, self.server_step_ms = projection(
            endpoint=self.endpoint,
            policy=self.policy,
            context=self.prompt_ids,
            tokens_per_step=tokens_per_step,
            k=k,
            verified=verified,
            stored=self._costs,
            draft_steps=draft_steps,
        )
        return value, basis

    def controller(self) -> ModeledLookahead | None:
        """Where prod would choose K per step (the batch loop's load-aware controller: the local path batched,
        ACE_BATCH_LOAD_AWARE_K on, greedy), that rule over the newest stored calibration's costs, with the
        acceptance this process's earlier replays of the pair left (as prod's controller carries it across
        requests); None where prod drafts the policy's K every step, or before the first calibration (the record
        is then projected at the policy's K when one arrives)."""
        policy = self.policy
        if not settings.PROD_BATCH_LOAD_AWARE_K or not batched_path(
            policy=policy, path=projected_path(policy=policy, endpoint=self.endpoint)
        ):
            return None
        try:
            self._costs = shadow_costs(endpoint=self.endpoint, policy=policy, context=self.prompt_ids)
        except Exception as exc:  # noqa: BLE001 - the fixed-K projection reports it
            logger.warning("reading the costs of endpoint %s failed: %s", self.endpoint.pk, exc)
            return None
        row = self._costs[0]
        if row is None:  # the fixed-K projection (project) says it is pending, from the same answer
            return None
        costs = row.step_costs()
        accepted, reached = _CARRIED.get(self._pair(), (PRIOR_ALPHA * PRIOR_WEIGHT, PRIOR_WEIGHT))
        return ModeledLookahead.over(
            verify_s=dict(costs.verify_s),
            draft_step_s=costs.draft_step_s,
            k=policy.k,
            accepted=accepted,
            reached=reached,
        )

    def project_modeled(self, controller: ModeledLookahead, stats: Any) -> tuple[float | None, str]:
        """S = the replay's tokens x the server step / the modeled time of the steps the controller chose."""
        _CARRIED[self._pair()] = (controller.accepted, controller.reached)
        row, note = self._costs
        self.server_step_ms = row.target_step_ms
        if not controller.steps or controller.modeled_s <= 0 or not stats.output_tokens:
            return None, "no projection: the replay made no step"
        k_mean = stats.drafted_tokens / stats.target_passes if stats.target_passes else 0.0
        value = stats.output_tokens * row.step_costs().target_step_s / controller.modeled_s
        basis = projection_basis(row, k=k_mean) + (f"; {note}" if note else "")
        return value, (
            f"K chosen per step as prod's load-aware controller would at load 1 over these costs (mean K "
            f"{k_mean:.2f} of {self.policy.k}, {stats.target_passes} steps); {basis}"
        )

    def _pair(self) -> tuple:
        return self.endpoint.pk, self.policy.mechanism, self.policy.draft_id, self.policy.k


# acceptance counts of the replays' controllers per (endpoint, mechanism, draft, K) in this worker process
_CARRIED: dict[tuple, tuple[float, float]] = {}


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
    shadowed = Shadowed(
        endpoint=endpoint,
        policy=policy,
        request_id=request_id,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        budget=max_tokens or len(output_ids),
        baseline_tok_s=len(output_ids) / (latency_ms / 1000.0) if latency_ms > 0 else None,
        common={"mechanism": policy.mechanism, "k": policy.k, "output_tokens": len(output_ids)}
        | {"latency_ms": latency_ms, "workload": workload},
    )
    sampling = None
    if not is_greedy(temperature):
        sampling = {"temperature": float(temperature), "top_k": max(0, int(top_k or 0)), "top_p": float(top_p)}
        _measure_sampled(shadowed, SamplingParams(**sampling))
    else:
        _measure_greedy(shadowed)
    # every other compatible candidate on the same request, within the endpoint's replay budget (auto-pairing),
    # on the background queue
    from speculation.worker.candidates import request_candidates

    request_candidates(
        endpoint=endpoint,
        request_id=request_id,
        workload=workload,
        prompt_ids=prompt_ids,
        output_ids=output_ids,
        max_tokens=shadowed.budget,
        sampling=sampling,
    )
    suffix_store.remember(endpoint.pk, request_id, output_ids)  # what suffix decoding drafts from next


def _measure_greedy(shadowed: Shadowed) -> None:
    """The exact replay of the policy's draft at the policy's K, projected with the stored costs."""
    drafting.for_kind(shadowed.policy.mechanism).measured_by(_Greedy(shadowed))


class _Greedy:
    """Shadow's greedy replay, one way per mechanism (speculation.drafting.Measure)."""

    def __init__(self, shadowed: Shadowed) -> None:
        self.shadowed = shadowed
        self.sequence = shadowed.prompt_ids + shadowed.output_ids
        self.common = {"prompt_len": len(shadowed.prompt_ids), "max_new_tokens": shadowed.budget}

    def lookup(self) -> None:
        _measure_lookup(self.shadowed, self.sequence, self.common, how="greedy replay (exact)")

    def hybrid(self) -> None:
        _measure_hybrid(self.shadowed, self.sequence, self.common)

    def eagle(self) -> None:
        _measure_eagle(self.shadowed, self.sequence, self.common)

    def draft_model(self) -> None:
        shadowed, policy = self.shadowed, self.shadowed.policy
        controller = shadowed.controller()
        draft = resources.model(policy.draft.path)
        width = resources.draft_width(draft, policy.target_path)
        predictions = draft_greedy_predictions(draft.model, self.sequence, width=width)
        stats = replay_greedy(predictions, self.sequence, policy.k, lookahead=controller, **self.common)
        _record_replay(shadowed, stats, controller, how="greedy replay (exact)")


def _measure_lookup(
    shadowed: Shadowed, sequence: list[int], common: dict[str, Any], *, how: str, sampled: bool = False
) -> None:
    """n-gram lookup or suffix decoding (the endpoint's earlier answers, this one's own left out) replayed against
    the output, greedy or sampled (exact either way); greedy with K chosen as prod's controller would where it
    chooses it, sampled at the policy's K (as a draft model's sampled traffic: a request's seed, which keeps K in
    prod, is not known here)."""
    policy = shadowed.policy
    controller = None if sampled else shadowed.controller()
    proposer = drafting.for_kind(policy.mechanism).endpoint_lookup(shadowed.endpoint.pk, exclude=shadowed.request_id)
    stats = replay_proposer(proposer, sequence, policy.k, lookahead=controller, **common)
    _record_replay(shadowed, stats, controller, how=how)


def _record_replay(shadowed: Shadowed, stats: Any, controller: ModeledLookahead | None, *, how: str) -> None:
    k = shadowed.policy.k
    if controller is not None:
        projected, basis = shadowed.project_modeled(controller, stats)
        shadowed.record(reason=f"{how}; {basis}", multiplier=projected, **stage_fields(stats, k=k))
        return
    k_mean = stats.drafted_tokens / stats.target_passes if stats.target_passes else 0.0
    # per target pass, steps that drafted nothing included (stats.tokens_per_pass)
    projected, basis = shadowed.project(tokens_per_step=stats.tokens_per_pass, k=k_mean)
    shadowed.record(reason=f"{how}; {basis}", multiplier=projected, **stage_fields(stats, k=k))


def _measure_hybrid(shadowed: Shadowed, sequence: list[int], common: dict[str, Any]) -> None:
    """Suffix decoding with the draft model's fallback, replayed as prod runs it (exact: the lookup over the
    endpoint's earlier answers, this one's own left out, and the draft's teacher-forced predictions); projected
    with the draft model's costs charged for the steps it drafted only."""
    policy, k = shadowed.policy, shadowed.policy.k
    mechanism = drafting.for_kind(policy.mechanism)
    lookup = mechanism.endpoint_lookup(shadowed.endpoint.pk, exclude=shadowed.request_id)
    stats = mechanism.replay(
        sequence, (k,), draft_path=policy.draft.path, lookup=lookup, common=common, target_path=policy.target_path
    )[k]
    how = f"greedy replay (exact) of suffix decoding with the draft's fallback ({stats.looked_up_tokens} of " \
          f"{stats.drafted_tokens} drafts looked up)"  # fmt: skip
    _record_hybrid(shadowed, stats, how=how)


def _record_hybrid(shadowed: Shadowed, stats: Any, *, how: str, **extra: Any) -> None:
    """Projected with the draft model's costs charged for the steps it drafted only (a draft model alone: every
    step's). extra: fields that replace the replay's (a sampled request's alpha is sum_x min(p, q))."""
    k = shadowed.policy.k
    k_mean = stats.drafted_tokens / stats.target_passes if stats.target_passes else 0.0
    projected, basis = shadowed.project(
        tokens_per_step=stats.tokens_per_pass, k=k_mean, draft_steps=stats.model_steps_per_pass
    )
    fields = stage_fields(stats, k=k)
    for name in ("target_passes", "drafted_tokens", "accepted_tokens"):  # expected counts (sampled) are floats
        fields[name] = round(fields[name])
    shadowed.record(reason=f"{how}; {basis}", multiplier=projected, **{**fields, **extra})


def _measure_eagle(
    shadowed: Shadowed,
    sequence: list[int],
    common: dict[str, Any],
    *,
    how: str = "greedy replay (exact) of the EAGLE head",
) -> None:
    """The policy's EAGLE head replayed as prod's local path drafts it: a chain of K, or the policy's draft tree
    (depth min(depth, K)) verified against the known output (speculation.engine.tree.replay_tree_greedy; a sampled
    request's too: the tree's candidates are one-hot, a child passes exactly where the sampled token is it). A head
    drafts from the target's hidden features, which only a target in this worker gives (one teacher-forced pass
    over the request): only a policy with a target_path can replay a head; a server returns no features."""
    policy, k = shadowed.policy, shadowed.policy.k
    if not policy.target_path:
        shadowed.record(reason="EAGLE head: not replayed, the head needs the target's features (no target_path)")
        return
    tree = TreeShape.from_policy(policy.eagle_tree)
    head = policy.draft.path
    stats = drafting.for_kind(policy.mechanism).replay(
        sequence, (k,), draft_path=head, target_path=policy.target_path, tree=tree, common=common
    )[k]
    k_mean = stats.drafted_tokens / stats.target_passes if stats.target_passes else 0.0
    verified = None
    if tree is not None:  # one verification checks every node: S = E[N] / (v(nodes) + depth c)
        verified = k_mean * tree_nodes(tree, k) / min(tree.depth, k)
        how += f" {TREE_REPLAY} {policy.eagle_tree} (depth min(depth, K), verified against the known output)"
    projected, basis = shadowed.project(tokens_per_step=stats.tokens_per_pass, k=k_mean, verified=verified)
    shadowed.record(reason=f"{how}; {basis}", multiplier=projected, **stage_fields(stats, k=k))


def _measure_sampled(shadowed: Shadowed, params: SamplingParams) -> None:
    """A lookup: its replay against the sampled output (exact). A draft model and the hybrid: their expected replay
    (speculation.engine.replay.expected_hybrid) with the draft's probability of passing given each sampled token,
    p and q processed as the request asked (speculation.worker.sampled); the record's alpha is the mean expected
    acceptance sum_x min(p, q). An EAGLE head: its tree exactly, its chain in expectation."""
    drafting.for_kind(shadowed.policy.mechanism).measured_by(_Sampled(shadowed, params))


class _Sampled(_Greedy):
    """Shadow's replay of a sampled request, one way per mechanism (speculation.drafting.Measure)."""

    def __init__(self, shadowed: Shadowed, params: SamplingParams) -> None:
        super().__init__(shadowed)
        self.params = params

    def lookup(self) -> None:
        how = f"{sampled_how(self.params)}: {SAMPLED_LOOKUP}"
        _measure_lookup(self.shadowed, self.sequence, self.common, how=how, sampled=True)

    def _no_draft(self) -> bool:
        policy = self.shadowed.policy
        if policy.draft is None:
            self.shadowed.record(reason=f"sampled traffic with {policy.mechanism}: no draft to compare")
        return policy.draft is None

    def _view(self) -> Any:
        shadowed = self.shadowed
        return target_view(
            endpoint=shadowed.endpoint, target_path=shadowed.policy.target_path, prompt_ids=shadowed.prompt_ids,
            output_ids=shadowed.output_ids, params=self.params,
        )  # fmt: skip

    def eagle(self) -> None:  # as the candidate replays (speculation.worker.candidates)
        shadowed, policy, k = self.shadowed, self.shadowed.policy, self.shadowed.policy.k
        if self._no_draft():
            return
        if TreeShape.from_policy(policy.eagle_tree) is not None:  # one-hot candidates: exact, as greedy's
            how = f"{sampled_how(self.params)}: replay (exact) of the EAGLE head"
            _measure_eagle(shadowed, self.sequence, self.common, how=how)
            return
        if not policy.target_path:
            shadowed.record(reason="EAGLE head: not replayed, the head needs the target's features (no target_path)")
            return
        stats = expected_chain_replays(
            self._view(), policy.draft.path, target_path=policy.target_path, prompt_ids=shadowed.prompt_ids,
            output_ids=shadowed.output_ids, max_tokens=shadowed.budget, ks=(k,),
        )[k]  # fmt: skip
        _record_hybrid(shadowed, stats, how=f"{sampled_how(self.params)}: {SAMPLED_CHAIN}")

    def draft_model(self) -> None:
        if not self._no_draft():
            self._expected(lookup=None)

    def hybrid(self) -> None:
        if self._no_draft():
            return
        shadowed = self.shadowed
        mechanism = drafting.for_kind(shadowed.policy.mechanism)
        self._expected(lookup=mechanism.endpoint_lookup(shadowed.endpoint.pk, exclude=shadowed.request_id))

    def _expected(self, *, lookup: Any) -> None:
        """A draft model (lookup None) or the hybrid: expected from the draft's probability of passing."""
        shadowed, policy, k = self.shadowed, self.shadowed.policy, self.shadowed.policy.k
        passes = draft_pass_probabilities(self._view(), policy.draft.path, shadowed.prompt_ids, shadowed.output_ids)
        stats = expected_hybrid_replays(
            lookup, passes.per_position.tolist(), self.sequence, (k,), prompt_len=len(shadowed.prompt_ids),
            max_new_tokens=shadowed.budget,
        )[k]  # fmt: skip
        how = f"{sampled_how(self.params)}: expected acceptance sum_x min(p, q) {passes.alpha:.4f}; "
        if lookup is not None:
            how += (
                f"suffix decoding with the draft's fallback ({stats.looked_up_tokens:.1f} of "
                f"{stats.drafted_tokens:.1f} drafts looked up, expected); {SAMPLED_LOOKUP}; "
            )
        how += f"the draft's steps expected from its probability of passing {passes.source}"
        _record_hybrid(shadowed, stats, how=how, alpha=passes.alpha, unseen_mass=passes.unseen_mass)
