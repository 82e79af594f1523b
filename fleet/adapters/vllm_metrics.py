"""vLLM's speculative-decoding metrics, read in one place: the probe (does the server speculate, with which K)
and the native path's stage records (acceptance per request) both go through here.

- /metrics: Prometheus counters `vllm:spec_decode_num_drafts`, `..._num_draft_tokens`, `..._num_accepted_tokens`
  and one `..._num_accepted_tokens_per_pos{position="i"}` series per draft position, summed over engines;
  present only when the server runs speculative decoding.
- per request: `metrics.speculative_decoding` in a response, with the same quantities for that request alone.
"""

from __future__ import annotations

import re
from collections import defaultdict

from fleet.adapters.wire import REQUESTS_RUNNING, sum_gauges

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"

_LINE = re.compile(r"^(vllm:spec_decode_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$")
_POSITION = re.compile(r'position="(\d+)"')


def parse_spec_counters(text: str) -> dict[str, float]:
    """Sum vLLM's spec-decode counters over engines; per-position counters keyed "...per_pos:<i>"."""
    totals: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if not match:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name.endswith("_created"):
            continue
        position = _POSITION.search(labels)
        if position:
            name = f"{name}:{position.group(1)}"
        totals[name] += value
    return dict(totals)


def speculates(counters: dict[str, float]) -> bool:
    """The server runs speculative decoding (it exports the drafts counter at all)."""
    return DRAFTS in counters


def positions(counters: dict[str, float]) -> list[int]:
    return sorted(int(name.rsplit(":", 1)[1]) for name in counters if name.startswith(PER_POSITION + ":"))


def stats_from_deltas(before: dict[str, float], after: dict[str, float]) -> dict:
    """Acceptance over the counters' growth between two scrapes (shared by concurrent requests)."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts = delta(DRAFTS)
    drafted = delta(DRAFT_TOKENS)
    accepted = delta(ACCEPTED)
    found = positions(after)
    return {
        "target_passes": int(drafts),
        "drafted_tokens": int(drafted),
        "accepted_tokens": int(accepted),
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_len": 1.0 + accepted / drafts if drafts else None,
        "per_position_acceptance": [delta(f"{PER_POSITION}:{i}") / drafts if drafts else 0.0 for i in found],
        "k": len(found) or None,
    }


def _per_position_from_histogram(histogram: list) -> list[int]:
    """vLLM's acceptance_histogram[j] counts verify steps that accepted exactly j drafts: position i was
    accepted by every step that accepted more than i."""
    return [int(sum(histogram[i + 1 :])) for i in range(max(0, len(histogram) - 1))]


def stats_from_request_metrics(spec: dict) -> dict:
    """Acceptance of one request from its own `metrics.speculative_decoding` (vLLM 0.32, served with
    `--per-request-spec-decode-metrics summary`: num_spec_steps, num_draft_tokens, num_accepted_draft_tokens,
    acceptance_histogram; the older counter names are read too)."""
    drafts = spec.get("num_spec_steps") or spec.get("num_drafts") or 0
    drafted = spec.get("num_draft_tokens") or 0
    accepted = spec.get("num_accepted_draft_tokens") or spec.get("num_accepted_tokens") or 0
    histogram = spec.get("acceptance_histogram")
    per_pos = _per_position_from_histogram(histogram) if isinstance(histogram, list) else None
    per_pos = per_pos if per_pos is not None else (spec.get("num_accepted_tokens_per_pos") or [])
    return {
        "target_passes": drafts,
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_len": 1.0 + accepted / drafts if drafts else None,
        "per_position_acceptance": [n / drafts for n in per_pos] if drafts else [],
        "k": spec.get("num_spec_tokens") or len(per_pos) or None,
    }


RUNNING = REQUESTS_RUNNING  # the key under which the requests running are kept beside the counters


def requests_running(text: str) -> float:
    """vLLM's gauge of requests running, summed over engines (0 when absent)."""
    return sum_gauges(text, ("vllm:num_requests_running",))
