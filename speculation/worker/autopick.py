"""`draft: auto` in prod: each request runs its workload's best candidate and K, and its own acceptance goes back
into the evidence.

The rule is auto-pairing's (speculation.selectors.autopairing.workload_choice: once PROD_MIN_REQUESTS requests are
measured, the (candidate, K) with the highest mean for the workload, shrunk toward every workload's pooled mean;
before that, the policy's draft and K). The table it reads (shadow's candidate rows, calibrations, and prod's own
rows below) is aggregated once per endpoint and TABLE_TTL_S per worker process, with the drafts it names: a request
with a cached table costs no database query for its choice (the gateway only puts the request's workload key in the
job).

Prod's evidence: after a greedy prod request that ran with `draft: auto`, one CandidateMeasurement row for the
candidate it ran, with the K it ran (the other K are None): its tokens per verification step, counts and the
projected multiplier from the candidate's newest stored cost calibration on that path (none: acceptance only; no
calibration runs here). For greedy traffic this is exactly what shadow's replay of that candidate would have
recorded, so prod keeps updating the estimate of the pairing it uses.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from fleet.models import Endpoint
from speculation import drafting
from speculation.engine.projection import MAX_PROJECTED_K
from speculation.engine.stats import SpecStats
from speculation.models import CandidateMeasurement, DraftModel, SpeculationPolicy, VerificationPath
from speculation.selectors import costs as cost_selectors
from speculation.selectors.autopairing import Choice, pairing_table, workload_choice

logger = logging.getLogger(__name__)

TABLE_TTL_S = 30.0
# What each worker path can run: an EAGLE head reads the target's hidden states, so only where it is loaded.
KINDS_ON_PATH = {
    path: frozenset(kind for kind, m in drafting.MECHANISMS.items() if m.path_problem(path) is None)
    for path in (VerificationPath.LOCAL, VerificationPath.REMOTE)
}


@dataclass(frozen=True)
class _Cached:
    at: float
    table: dict
    drafts: dict[int, DraftModel]


_tables: dict[int, _Cached] = {}
_lock = threading.Lock()


def _table(endpoint_id: int) -> _Cached:
    """The endpoint's auto-pairing table and the drafts it names, rebuilt after TABLE_TTL_S."""
    with _lock:
        found = _tables.get(endpoint_id)
    if found is not None and time.monotonic() - found.at < TABLE_TTL_S:
        return found
    table = pairing_table(endpoint_id=endpoint_id)
    ids = {c.draft_id for entry in table["workloads"].values() for c in entry["cells"] if c.draft_id is not None}
    drafts = {d.pk: d for d in DraftModel.objects.filter(pk__in=ids)} if ids else {}
    found = _Cached(at=time.monotonic(), table=table, drafts=drafts)
    with _lock:
        _tables[endpoint_id] = found
    return found


def forget(endpoint_id: int | None = None) -> None:
    """Drop the cached table(s) (tests; a process that must see new evidence at once)."""
    with _lock:
        if endpoint_id is None:
            _tables.clear()
        else:
            _tables.pop(endpoint_id, None)


def policy_choice(policy: SpeculationPolicy, k: int) -> Choice:
    """The policy's own candidate and K (what `draft: auto` falls back to)."""
    mechanism = drafting.for_kind(policy.mechanism)
    name = mechanism.candidate_name(policy.draft)  # a lookup is named after its kind ("ngram", "suffix")
    draft_id = None if mechanism.looks_up else policy.draft_id
    return Choice(name, policy.mechanism, draft_id, k, "", from_evidence=False)


def choose(
    *, endpoint: Endpoint, policy: SpeculationPolicy, workload: str, path: str, k: int
) -> tuple[SpeculationPolicy, Choice]:
    """The policy this request runs with (the chosen candidate as its mechanism and draft) and the choice."""
    current = policy_choice(policy, k)
    cached = _table(endpoint.pk)
    choice = workload_choice(cached.table, workload=workload, current=current, kinds=KINDS_ON_PATH.get(path))
    if choice.candidate == current.candidate and choice.kind == current.kind:
        return policy, choice
    draft = None
    if not drafting.for_kind(choice.kind).looks_up:
        draft = cached.drafts.get(choice.draft_id)
        if draft is None:
            return policy, Choice(
                current.candidate,
                current.kind,
                current.draft_id,
                k,
                f"auto: {choice.candidate} is no longer registered: the policy's {current.candidate} K={k}",
                from_evidence=False,
            )
    chosen = copy.copy(policy)  # never saved: this request's view of the policy
    chosen.mechanism, chosen.k = choice.kind, choice.k
    if draft is not None:  # lookups draft with no weights; the policy's draft directory stays its tokenizer
        chosen.draft = draft
    return chosen, choice


def _costs(endpoint_id: int, node_class: str, draft_id: int | None, path: str):
    row = cost_selectors.newest_calibration(
        endpoint_id=endpoint_id, node_class=node_class, path=path, draft_id=draft_id
    )
    return row.step_costs() if row is not None else None


def evidence_row(
    *,
    endpoint_id: int,
    node_class: str,
    request_id: str,
    workload: str,
    choice: Choice,
    stats: SpecStats,
    k: int,
    path: str,
) -> CandidateMeasurement | None:
    """Prod's own measurement of the candidate it ran, at the K it ran (None where there is nothing to add)."""
    if not 1 <= k <= MAX_PROJECTED_K or stats.target_passes == 0:
        return None
    tau = stats.mean_accepted_len if stats.drafts else 1.0  # no drafts: one token per step, as plain decoding
    k_mean = stats.drafted_tokens / stats.target_passes
    costs = _costs(endpoint_id, node_class, choice.draft_id, path)
    per_k: dict[str, list[Any]] = {name: [None] * MAX_PROJECTED_K for name in ("mal", "mult", "counts", "pos")}
    per_k["mal"][k - 1] = round(tau, 4)
    per_pass = stats.tokens_per_pass  # steps that drafted nothing included
    steps = stats.model_steps_per_pass  # a hybrid's looked-up drafts cost no draft step
    per_k["mult"][k - 1] = (
        round(costs.multiplier(tokens_per_step=per_pass, k=k_mean, draft_steps=steps), 4) if costs else None
    )
    per_k["counts"][k - 1] = [stats.drafted_tokens, stats.accepted_tokens, stats.target_passes]
    per_k["pos"][k - 1] = [round(a, 4) for a in stats.alpha_per_position]
    return CandidateMeasurement.objects.create(
        endpoint_id=endpoint_id,
        request_id=request_id,
        workload=workload,
        candidate=choice.candidate,
        kind=choice.kind,
        draft_id=choice.draft_id,
        output_tokens=stats.output_tokens,
        mean_accepted_len=per_k["mal"],
        multiplier=per_k["mult"],
        counts=per_k["counts"],
        per_position=per_k["pos"],
        best_k=k,
        best_multiplier=per_k["mult"][k - 1],
        reason=f"prod on path {path} at K = {k} (greedy: exact)"
        + ("" if costs else "; no projection: no cost calibration of this candidate on this path yet"),
    )


def record_evidence(**fields: Any) -> None:
    """evidence_row, never failing the request (it is already answered)."""
    try:
        evidence_row(**fields)
    except Exception:  # noqa: BLE001 - logged with the request id; the answer and its record stand
        logger.exception("request %s: prod's auto-pairing evidence not written", fields.get("request_id"))
