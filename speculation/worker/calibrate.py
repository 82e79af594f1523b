"""Calibration: Spec-Bench prompts through an endpoint, every candidate replayed on each, a per-category table.

`python manage.py calibrate ENDPOINT [--sample N] [--json PATH]` (speculation.management.commands.calibrate).
The first N prompts of each Spec-Bench category (the vendored questions, first turn) go to the endpoint's server
as greedy completions asking for their token ids (the server kind's wire format), and every compatible
candidate is replayed on each exactly as shadow does (speculation.worker.candidates, outside the live replay
budget). The rows are stored like shadow's, keyed by the prompt's workload category, so a calibration seeds the
endpoint page's auto-pairing table. The table per Spec-Bench category and candidate reports, at the K with the
best mean projected multiplier (the best mean tokens per step when no costs could be measured): the acceptance
rate (accepted / drafted), the mean accepted length (tokens per verification step, bonus included) and the
projected multiplier, like Spec-Bench's leaderboard.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from typing import Any

import httpx

from fleet.adapters import wire_for
from fleet.models import Endpoint
from fleet.netpolicy import PinnedTransport
from speculation.models import CandidateMeasurement, CandidateStatus
from speculation.offline.eagle.prompts import read_prompts, spec_bench_path
from speculation.services.policies import get_policy
from speculation.worker import suffix_store
from speculation.worker.candidates import K_RANGE, measure_candidates
from speculation.workloads.classifier import CATEGORY_OF

REQUEST_TIMEOUT_S = 300.0


def sample_prompts(per_category: int) -> list[tuple[str, str]]:
    """(Spec-Bench category, first turn): the first `per_category` prompts of every category, in file order."""
    taken: dict[str, int] = defaultdict(int)
    chosen = []
    for prompt in read_prompts(str(spec_bench_path())):
        if taken[prompt.category] < per_category:
            taken[prompt.category] += 1
            chosen.append((prompt.category, prompt.text))
    return chosen


def served_ids(
    client: httpx.Client, endpoint: Endpoint, prompt: str, *, max_tokens: int
) -> tuple[list[int], list[int]]:
    """The prompt's and the greedy output's token ids, as the endpoint's server produced them."""
    wire = wire_for(endpoint.kind)
    body = {"model": endpoint.served_model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    key = endpoint.api_key
    response = client.post(
        endpoint.base_url.rstrip("/") + "/v1/completions",
        json={**body, **wire.token_ids_fields()},
        headers={"Authorization": f"Bearer {key}"} if key else {},
        timeout=REQUEST_TIMEOUT_S,
    )
    response.raise_for_status()
    seen = wire.take_token_ids(response.json(), strip=False)
    if not seen.prompt_ids or not seen.output_ids:
        raise ValueError("the server's answer carries no prompt or output token ids")
    return seen.prompt_ids, seen.output_ids


def summarize(rows: list[CandidateMeasurement]) -> dict[str, Any]:
    """Per candidate: requests, and at its best K the acceptance rate, tokens per step and projected multiplier."""
    measured = [r for r in rows if r.status == CandidateStatus.MEASURED]
    if not measured:
        return {"requests": 0, "failed": len(rows)}
    n = len(measured)
    mult = [[r.multiplier[i] for r in measured if r.multiplier[i] is not None] for i in range(len(K_RANGE))]
    mal = [sum(r.mean_accepted_len[i] for r in measured) / n for i in range(len(K_RANGE))]
    scores = [sum(m) / len(m) if len(m) == n else None for m in mult]
    have_costs = all(s is not None for s in scores)
    best = max(range(len(K_RANGE)), key=lambda i: ((scores[i] if have_costs else mal[i]), -i))
    drafted = sum(r.counts[best][0] for r in measured)
    accepted = sum(r.counts[best][1] for r in measured)
    return {
        "requests": n,
        "failed": len(rows) - n,
        "best_k": K_RANGE[best],
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "mean_accepted_len": round(mal[best], 4),
        "projected_multiplier": round(scores[best], 4) if have_costs else None,
    }


def calibrate(*, endpoint: Endpoint, sample: int, max_tokens: int) -> dict[str, Any]:
    """Run the calibration; the table {"categories": {category: {candidate: summary}}} plus what was sent."""
    policy = get_policy(endpoint=endpoint)
    by_cell: dict[tuple[str, str], list[CandidateMeasurement]] = defaultdict(list)
    errors: dict[str, list[str]] = defaultdict(list)
    prompts = sample_prompts(sample)
    client = httpx.Client(transport=PinnedTransport())  # only to addresses the network policy allows
    for category, text in prompts:
        try:
            prompt_ids, output_ids = served_ids(client, endpoint, text, max_tokens=max_tokens)
        except Exception as exc:  # noqa: BLE001 - one prompt's failure is reported, the rest still runs
            errors[category].append(f"{type(exc).__name__}: {exc}")
            continue
        request_id = f"calibrate-{uuid.uuid4().hex[:16]}"
        rows = measure_candidates(
            endpoint=endpoint,
            policy=policy,
            request_id=request_id,
            workload=CATEGORY_OF.get(category, category),
            prompt_ids=prompt_ids,
            output_ids=output_ids,
            max_tokens=max_tokens,
            budgeted=False,
        )
        suffix_store.remember(endpoint.pk, request_id, output_ids)  # the next prompts' suffix decoding drafts from it
        for row in rows:
            by_cell[(category, row.candidate)].append(row)
    client.close()
    categories: dict[str, dict[str, Any]] = defaultdict(dict)
    for (category, candidate), rows in sorted(by_cell.items()):
        categories[category][candidate] = summarize(rows)
    return {
        "endpoint": endpoint.name,
        "sample_per_category": sample,
        "max_tokens": max_tokens,
        "prompts": len(prompts),
        "categories": dict(categories),
        "errors": dict(errors),
    }


def format_table(result: dict[str, Any]) -> str:
    """The table as text: one line per category and candidate."""
    head = f"{'category':<15} {'candidate':<20} {'n':>3} {'K':>2} {'accept':>7} {'tok/step':>8} {'proj x':>7}"
    lines = [head, "-" * len(head)]

    def num(value: Any, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for category, cells in result["categories"].items():
        for candidate, cell in cells.items():
            lines.append(
                f"{category:<15} {candidate:<20} {cell['requests']:>3} {cell.get('best_k') or '-':>2} "
                f"{num(cell.get('acceptance_rate'), 3):>7} {num(cell.get('mean_accepted_len'), 2):>8} "
                f"{num(cell.get('projected_multiplier'), 2):>7}"
            )
    for category, problems in result["errors"].items():
        lines.append(f"{category}: {len(problems)} prompt(s) failed: {problems[0]}")
    return "\n".join(lines)
