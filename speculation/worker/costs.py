"""c and v for shadow's projection, measured on this worker (the endpoint's node class) and kept in the database.

One calibration measures (repeated timings; the worker's own work: its fastest repeat, speculation.engine.costs;
the server's step: the median, as the server runs under its own load):
- the target step: the server's plain decode step, (T(1 + N tokens) - T(1 token)) / N of a greedy plain
  generation, so prefill, HTTP round trip and request overhead cancel (not a request's latency per token);
- the draft step: this worker's draft proposing over a warm cache (0 for n-gram lookup);
- verify(n): one verification of n tokens on prod's path: the target loaded in this worker (local), or the
  server's scoring call (remote).
c = draft step / target step, v(K) = verify(K + 1) / target step: the same cost model as the lookahead
controller (speculation.engine.projection.StepCosts). A calibration is reused for COST_REFRESH_S, then measured
again on the next shadow request, so a noisy moment is not kept forever.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any

import httpx
from django.conf import settings

from fleet.adapters import Unsupported, WireError, wire_for
from fleet.models import Endpoint
from speculation.engine import DraftModelProposer, LocalTarget, NgramProposer
from speculation.engine.costs import REPEATS, time_draft_step, time_verify
from speculation.engine.projection import MAX_PROJECTED_K, StepCosts
from speculation.engine.target import TargetOutput
from speculation.models import CostCalibration, Mechanism, SpeculationPolicy, VerificationPath
from speculation.selectors import costs as cost_selectors
from speculation.selectors.options import effective_path
from speculation.services import costs as cost_service
from speculation.worker.paths import resources

logger = logging.getLogger(__name__)

SERVER_STEP_TOKENS = 16  # the plain generation's extra tokens the decode step is read from
SERVER_REPEATS = 3
CONTEXT_TOKENS = 64  # the context the timings run after (the request's prompt, cut)
VERIFY_SIZES = (1, 2, 3, 5, MAX_PROJECTED_K + 1)  # tokens verified; the others are interpolated
SERVER_TIMEOUT = httpx.Timeout(connect=5.0, read=120.0, write=30.0, pool=30.0)

_measuring = threading.Lock()  # one calibration at a time per worker process


class CalibrationError(RuntimeError):
    """The costs could not be measured now (the server unreachable, an unexpected answer)."""


def projected_path(*, policy: SpeculationPolicy, endpoint: Endpoint) -> str:
    """The path shadow projects for: local when prod would verify in the worker, else the server's scoring."""
    path = effective_path(policy=policy, endpoint=endpoint)
    return VerificationPath.LOCAL if path == VerificationPath.LOCAL and policy.target_path else VerificationPath.REMOTE


def current_costs(*, endpoint: Endpoint, policy: SpeculationPolicy, context: list[int]) -> CostCalibration:
    """The newest calibration of this endpoint, draft and path on this node class, measured now if none is fresh."""
    path = projected_path(policy=policy, endpoint=endpoint)
    key = dict(endpoint_id=endpoint.pk, node_class=endpoint.node_class, path=path, draft_id=policy.draft_id)
    found = cost_selectors.fresh_calibration(**key, max_age_s=settings.COST_REFRESH_S)
    if found is not None:
        return found
    with _measuring:
        found = cost_selectors.fresh_calibration(**key, max_age_s=settings.COST_REFRESH_S)
        if found is not None:  # another thread of this process measured it meanwhile
            return found
        costs = measure(endpoint=endpoint, policy=policy, path=path, context=context[:CONTEXT_TOKENS])
        return cost_service.record_calibration(
            endpoint=endpoint,
            draft=policy.draft,
            path=path,
            costs=costs,
            repeats=REPEATS,
            context_tokens=min(len(context), CONTEXT_TOKENS),
        )


def measure(*, endpoint: Endpoint, policy: SpeculationPolicy, path: str, context: list[int]) -> StepCosts:
    from speculation.worker.generation import _headers, http

    target_step = server_step_seconds(client=http(), endpoint=endpoint, headers=_headers(endpoint), prompt_ids=context)
    if policy.mechanism == Mechanism.NGRAM or policy.draft is None:
        draft_step = time_draft_step(NgramProposer(), context)
    else:
        model = resources.model(policy.draft.path).model
        draft_step = time_draft_step(DraftModelProposer(model, target_vocab_size=model.vocab_size), context)
    if path == VerificationPath.LOCAL:
        target: Any = LocalTarget(resources.model(policy.target_path).model)
    else:
        target = ScoringCallTarget(client=http(), endpoint=endpoint, headers=_headers(endpoint))
    try:
        verify = time_verify(target, context, VERIFY_SIZES, repeats=REPEATS)
    except (httpx.HTTPError, WireError, Unsupported) as exc:
        raise CalibrationError(f"timing the server's scoring call failed: {type(exc).__name__}: {exc}") from exc
    return StepCosts(target_step_s=target_step, draft_step_s=draft_step, verify_s=verify)


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


class ScoringCallTarget:
    """The engine's Target protocol over the server's scoring call, for timing only: forward() scores the context
    and the new tokens in one call, as the remote path verifies a step (speculation.worker.paths.remote)."""

    def __init__(self, *, client: httpx.Client, endpoint: Endpoint, headers: dict[str, str]) -> None:
        import torch

        self.client, self.endpoint, self.headers = client, endpoint, headers
        self.wire = wire_for(endpoint.kind)
        self.device = torch.device("cpu")
        self.vocab_size = 0
        self.max_context = int((endpoint.capabilities or {}).get("max_context") or 1 << 30)
        self.tokens: list[int] = []

    def prefill(self, prompt_ids: list[int]) -> None:
        self.tokens = list(prompt_ids[:-1])

    def forward(self, tokens: Any, *, return_hidden: bool = False) -> TargetOutput:
        import torch

        ids = self.tokens + [int(t) for t in tokens.tolist()]
        request = self.wire.score(model=self.endpoint.served_model, token_ids=ids, top_n=1)
        response = self.client.request(
            request.method,
            self.endpoint.base_url.rstrip("/") + request.path,
            json=request.json,
            headers=self.headers,
            timeout=SERVER_TIMEOUT,
        )
        response.raise_for_status()
        self.wire.parse_score(response.json(), token_ids=ids, top_n=1)
        self.tokens = ids
        return TargetOutput(logits=torch.zeros(tokens.shape[0], 1), hidden=None)  # [T, 1]: timing only

    def rollback(self, length: int) -> None:
        del self.tokens[length:]


def projection(
    *, endpoint: Endpoint, policy: SpeculationPolicy, context: list[int], tokens_per_step: float, k: float
) -> tuple[float | None, str]:
    """Shadow's projected multiplier S = E[N] / (v(K) + K c) from this worker's calibration, and how it was made
    (for the record's reason); None with the reason when the costs cannot be measured now."""
    try:
        row = current_costs(endpoint=endpoint, policy=policy, context=context)
    except Exception as exc:  # noqa: BLE001 - the measurement is still recorded, without a projection
        logger.warning("cost calibration of endpoint %s failed: %s", endpoint.pk, exc)
        return None, f"no projection: the costs could not be measured ({type(exc).__name__}: {exc})"
    costs = row.step_costs()
    return costs.multiplier(tokens_per_step=tokens_per_step, k=k), (
        f"projection for the {row.path} path with c={costs.c:.3f}, v={costs.v(k):.3f} measured on {row.node_class} "
        f"at {row.measured_at:%H:%M:%S} ({row.repeats} timings each)"
    )
