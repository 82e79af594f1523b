"""Which verification path `path: auto` means for one endpoint: chosen by speed, fixed when the policy is saved.

The candidates are the paths this endpoint and policy can run (native: the server speculates itself; local:
the policy names the target's model directory; remote: the server scores token-id prompts; an EAGLE head
runs on local only). Each is ranked by its measured multiplier (the median of the newest prod records that
ran on it) when there are enough of them, else by its projected multiplier (the shadow replays' projection,
which models an in-process verification: it applies to local and native, not to remote, whose every step
re-scores the whole sequence); paths with neither keep the design's order (native, local, remote). A path
measured slower than plain is never chosen automatically.

The result is stored on the policy (`resolved_path`, `path_evidence`) by the policy service when the policy is
saved or explicitly re-evaluated, and recorded in the change history; routing reads the stored value, so a
re-probe never moves traffic by itself (`path_warning` says when it would).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path

from fleet.models import Endpoint
from speculation import drafting
from speculation.models import Action, Mode, SpeculationPolicy, StageRecord, VerificationPath
from speculation.selectors import capabilities, native_flags

MEASURED_WINDOW = 20  # newest prod records per path
MIN_MEASURED = 3  # fewer than this: not a measurement yet
SCAN_WINDOW = 200  # newest records per action looked through for those (ten times MEASURED_WINDOW)
PRIOR_ORDER = (VerificationPath.NATIVE, VerificationPath.LOCAL, VerificationPath.REMOTE)
PROJECTED_PATHS = (VerificationPath.NATIVE, VerificationPath.LOCAL)


@dataclass(frozen=True)
class PathEvidence:
    path: str
    runnable: bool
    why: str = ""  # why not runnable, or why not chosen automatically
    measured: float | None = None  # median multiplier of the newest prod records on this path
    measured_requests: int = 0
    projected: float | None = None  # median projected multiplier of the newest shadow replays
    projected_requests: int = 0

    @property
    def score(self) -> float | None:
        return self.measured if self.measured is not None else self.projected

    @property
    def eligible(self) -> bool:
        return self.runnable and not (self.measured is not None and self.measured < 1.0)

    def summary(self) -> str:
        if not self.runnable:
            return f"{self.path}: cannot run ({self.why})"
        parts = []
        if self.measured is not None:
            parts.append(f"measured {self.measured:.2f}x over {self.measured_requests} requests")
        if self.projected is not None:
            parts.append(f"projected {self.projected:.2f}x from {self.projected_requests} shadow replays")
        text = f"{self.path}: " + (", ".join(parts) if parts else "no measurement yet")
        return text + (" - slower than plain, never chosen automatically" if not self.eligible else "")


@dataclass(frozen=True)
class PathChoice:
    path: str  # "" when no path is eligible
    evidence: list[PathEvidence]

    def as_json(self) -> list[dict]:
        return [{**asdict(e), "summary": e.summary()} for e in self.evidence]

    def summary(self) -> str:
        chosen = self.path or "none"
        return f"auto -> {chosen}; " + "; ".join(e.summary() for e in self.evidence)


def _median(values: list[float]) -> tuple[float | None, int]:
    values = values[:MEASURED_WINDOW]
    if len(values) < MIN_MEASURED:
        return None, len(values)
    return round(statistics.median(values), 4), len(values)


_remembered: ContextVar[dict[int, dict] | None] = ContextVar("path_evidence", default=None)


@contextmanager
def remembered() -> Iterator[None]:
    """Within this block each endpoint's evidence is read once (a page asks for it per mode and path option)."""
    token = _remembered.set({})
    try:
        yield
    finally:
        _remembered.reset(token)


def _newest_multipliers(endpoint: Endpoint) -> dict[tuple[str, str], list[float]]:
    """Multipliers, newest first, per (mode, path) of shadow replays and prod runs, from the newest SCAN_WINDOW
    records of each action: an index range read that stays short however many records the endpoint has."""
    memo = _remembered.get()
    if memo is not None and endpoint.pk in memo:
        return memo[endpoint.pk]
    found: dict[tuple[str, str], list[float]] = {}
    for action in (Action.WOULD_SPECULATE, Action.SPECULATED):
        rows = (
            StageRecord.objects.filter(endpoint=endpoint, action=action)
            .order_by("-created_at")
            .values_list("mode", "path", "multiplier")[:SCAN_WINDOW]
        )
        for mode, path, multiplier in rows:
            if multiplier is not None:
                found.setdefault((mode, path if mode == Mode.PROD.value else ""), []).append(multiplier)
    if memo is not None:
        memo[endpoint.pk] = found
    return found


def _why_not(path: str, policy: SpeculationPolicy, endpoint: Endpoint) -> str:
    mechanism = drafting.MECHANISMS.get(policy.mechanism)
    # whether ACE manages the server is validation's question (speculation.services.policies), not the path's
    if mechanism is not None:
        head = native_flags.head_problem
        problem = mechanism.path_problem(path, head_problem=lambda: head(server_kind=endpoint.kind, draft=policy.draft))
        if problem:
            return problem
    if path == VerificationPath.NATIVE and not capabilities.native_speculation(endpoint):
        return "the server does not speculate itself"
    if path == VerificationPath.REMOTE and not capabilities.can_score_token_prompts(endpoint):
        return "the server does not score token-id prompts by token id (vLLM prompt_logprobs, SGLang return_logprob)"
    if path == VerificationPath.LOCAL:
        if not policy.target_path:
            return "no target_path"
        if not (Path(policy.target_path) / "config.json").is_file():
            return "target_path holds no config.json"
    return ""


def choose_path(*, policy: SpeculationPolicy, endpoint: Endpoint) -> PathChoice:
    """The fastest eligible path for this policy on this endpoint now, with the evidence for every path."""
    newest = _newest_multipliers(endpoint)
    projected, projected_n = _median(newest.get((Mode.SHADOW.value, ""), []))
    evidence = []
    for path in PRIOR_ORDER:
        why = _why_not(path, policy, endpoint)
        measured, measured_n = _median(newest.get((Mode.PROD.value, path.value), []))
        proj = path in PROJECTED_PATHS
        evidence.append(
            PathEvidence(
                path=path.value,
                runnable=not why,
                why=why,
                measured=measured,
                measured_requests=measured_n,
                projected=projected if proj else None,
                projected_requests=projected_n if proj and projected is not None else 0,
            )
        )
    ranked = sorted(
        (e for e in evidence if e.eligible),
        key=lambda e: (e.score is None, -(e.score or 0.0), PRIOR_ORDER.index(VerificationPath(e.path))),
    )
    return PathChoice(path=ranked[0].path if ranked else "", evidence=evidence)
