"""Expected acceptance of a draft on a finished sampled request, for shadow and for auto-pairing's candidates.

sum_x min(p(x), q(x)) per output position with p (the target) and q (the draft) processed as the request asked
(temperature, top-k, top-p): exact from the target's logits when the worker holds the target (the policy's
target_path), else from the server's top-N log-probabilities (one scoring call; exact when 0 < top_k < N, otherwise
a lower bound recorded with the mass it could not see: speculation.engine.acceptance). The target's side is read
once per request (``TargetView``) and serves every draft compared with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fleet.models import Endpoint
from speculation.engine.sampling import SamplingParams, probs_from_logits
from speculation.worker import upstream
from speculation.worker.paths import resources
from speculation.worker.paths.drafting import teacher_forced_logits

SCORING_LOGPROBS = 20


@dataclass(frozen=True)
class TargetView:
    """The target's side of sum_x min(p, q) on one request: p exactly ([n, V]), or the server's top-N."""

    params: SamplingParams
    p: torch.Tensor | None = None  # [n, V] processed, when the worker holds the target
    top: list[dict[int, float]] | None = None  # per output position: token -> raw logprob, the top-N
    top_n: int = 0


@dataclass(frozen=True)
class Acceptance:
    per_position: torch.Tensor  # [n]
    unseen_mass: float | None  # None when exact
    source: str  # for the record's reason
    average: torch.Tensor | None = None  # [n] sum_x min(p, q), where per_position is given each sampled token

    @property
    def alpha(self) -> float:
        """The mean expected acceptance sum_x min(p, q) over the output positions."""
        values = self.per_position if self.average is None else self.average
        return float(values.mean()) if values.numel() else 0.0


def target_view(
    *, endpoint: Endpoint, target_path: str, prompt_ids: list[int], output_ids: list[int], params: SamplingParams
) -> TargetView:
    """The target's processed distributions from its weights in the worker, else the server's top-N (one call)."""
    if target_path:
        target = resources.model(target_path).model
        return TargetView(
            params=params, p=probs_from_logits(teacher_forced_logits(target, prompt_ids, output_ids), params)
        )
    top, top_n = server_top_logprobs(endpoint, prompt_ids, output_ids)
    return TargetView(params=params, top=top, top_n=top_n)


def acceptance(view: TargetView, draft_logits: torch.Tensor) -> Acceptance:
    """sum_x min(p, q) per position for a draft's teacher-forced logits [n, V]."""
    from speculation.engine.acceptance import expected_acceptance_exact, expected_acceptance_from_top

    q = probs_from_logits(draft_logits, view.params)  # [n, V]
    if view.p is not None:
        return Acceptance(expected_acceptance_exact(view.p, q), None, "exact, from the target's logits in the worker")
    per_position, unseen, exact = expected_acceptance_from_top(view.top, q, view.params)
    if exact:
        return Acceptance(
            per_position,
            None,
            f"exact, from the server's top-{view.top_n} log-probabilities (top_k {view.params.top_k} < {view.top_n})",
        )
    unseen_mass = float(unseen.mean()) if unseen.numel() else 0.0
    return Acceptance(
        per_position,
        unseen_mass,
        f"a lower bound from the server's top-{view.top_n} log-probabilities; mean unseen probability mass "
        f"{unseen_mass:.4f}",
    )


def draft_logits(view: TargetView, draft_path: str, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """The draft's teacher-forced logits [n, V], over the target's ids where the target's checkpoint pads the
    vocabulary to another size (the tokenizer's ids, as prod's local path drafts: speculation.engine.vocab)."""
    from speculation.engine.vocab import draft_width, widen

    draft = resources.model(draft_path)
    logits = teacher_forced_logits(draft.model, prompt_ids, output_ids)
    target_vocab = view.p.shape[-1] if view.p is not None else logits.shape[-1]
    if target_vocab == logits.shape[-1]:
        return logits
    return widen(logits, draft_width(logits.shape[-1], target_vocab, len(draft.tokenizer)), target_vocab)


def draft_acceptance(view: TargetView, draft_path: str, prompt_ids: list[int], output_ids: list[int]) -> Acceptance:
    return acceptance(view, draft_logits(view, draft_path, prompt_ids, output_ids))


def draft_pass_probabilities(
    view: TargetView, draft_path: str, prompt_ids: list[int], output_ids: list[int]
) -> Acceptance:
    """Per output position, the probability that the draft's sampled draft passed there given the token the
    server sampled, min(1, q(o) / p(o)) (speculation.engine.acceptance.pass_given_tokens). Kept per sampled token it
    carries what the average sum_x min(p, q) loses (the positions where the draft passed are those whose tokens it
    favoured), so a replay over the sampled output with these is exact in expectation
    (speculation.engine.replay.expected_hybrid). Needs p(o) exactly: from the target in the worker, or a server's
    top-N under 0 < top_k < N; otherwise sum_x min(p, q) per position (a lower bound, as ``acceptance``)."""
    from speculation.engine.acceptance import pass_given_tokens, target_from_top_logprobs

    logits = draft_logits(view, draft_path, prompt_ids, output_ids)
    q = probs_from_logits(logits, view.params)  # [n, V]
    if view.p is not None:
        p = view.p
    else:
        bounds = [target_from_top_logprobs(dist, view.params, q.shape[-1]) for dist in view.top]
        if not bounds or not all(b.exact for b in bounds):
            return acceptance(view, logits)
        p = torch.stack([b.p for b in bounds])
    per_token, average = pass_given_tokens(p, q, torch.tensor(output_ids, dtype=torch.long))
    if view.p is not None:
        source = "exact, from the target's logits in the worker"
    else:
        source = (
            f"exact, from the server's top-{view.top_n} log-probabilities (top_k {view.params.top_k} < {view.top_n})"
        )
    return Acceptance(per_token, None, f"{source}, given each sampled token", average=average)


def server_top_logprobs(endpoint: Endpoint, prompt_ids: list[int], output_ids: list[int]) -> tuple[list[Any], int]:
    """The server's top-N raw log-probabilities at every output position (one scoring call through the server
    kind's wire format), and N. fleet.adapters.Unsupported when the server kind cannot score token ids."""
    from fleet.adapters import wire_for

    wire = wire_for(endpoint.kind)
    top_n = min(SCORING_LOGPROBS, int(endpoint.capabilities.get("max_logprobs") or SCORING_LOGPROBS))
    sequence = prompt_ids + output_ids
    request = wire.score(model=endpoint.served_model, token_ids=sequence, top_n=top_n)
    url = endpoint.base_url.rstrip("/") + request.path
    response = upstream.http().request(
        request.method, url, headers=upstream.headers(endpoint), timeout=120, json=request.json
    )
    response.raise_for_status()
    scored = wire.parse_score(response.json(), token_ids=sequence, top_n=top_n)
    # only the top-N by rank are a complete head (the output token's own log-probability is kept apart)
    top = [{t.token_id: t.logprob for t in position.top} for position in scored.positions[len(prompt_ids) :]]
    return top, top_n


def eagle_chain_passes(
    view: TargetView, head_path: str, target_path: str, prompt_ids: list[int], output_ids: list[int], depth: int
) -> list[list[float]]:
    """Per output position i, the probability that the j-th draft of an EAGLE head's sampled chain starting there
    passed given the sampled tokens (speculation.engine.eagle.chain_pass_probabilities: one target pass for the
    features, depth head steps per position; p exact: a head needs the target in the worker)."""
    from speculation.engine.eagle import EagleProposer, chain_pass_probabilities

    if view.p is None:
        raise ValueError("an EAGLE head's chain needs the target's own distribution (the target in the worker)")
    target = resources.model(target_path).model
    head = resources.eagle_head(head_path, target_dir=target_path)
    sequence = prompt_ids + output_ids
    with torch.inference_mode():
        wants = EagleProposer(head, target).wants_hidden
        hidden = target(torch.tensor(sequence, device=target.output.weight.device), 0, return_hidden=wants).hidden
    return chain_pass_probabilities(
        head, target, sequence, hidden, prompt_len=len(prompt_ids), depth=depth, p=view.p, params=view.params
    )
