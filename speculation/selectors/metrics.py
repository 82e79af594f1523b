"""The stage's Prometheus metrics (prometheus_client), fed from the one place each fact is decided.

- `ace_requests_total{endpoint, mode, action}`: every gateway request once, as `passthrough` (off and shadow:
  the client got the server's own answer) or as the action of the prod stage record (`speculated`, `skipped`,
  `fell_back`); shadow measurements count as `would_speculate` on top, when their record is written. So
  `sum without(action) (ace_requests_total{action!="would_speculate"})` is the gateway's request count.
- `ace_acceptance_rate`, `ace_mean_accepted_length`, `ace_multiplier` (histograms, per endpoint and mode: prod
  measured, shadow projected) and `ace_drafted_tokens_total` / `ace_accepted_tokens_total` (vLLM's
  `spec_decode_num_draft_tokens` / `num_accepted_tokens` counterparts), from every stage record.
- `ace_stage_record_write_failures_total` and `ace_stage_records_dropped_total`: records the database refused, and
  records dropped because the web process's write queue was full (speculation.services.records).
- `ace_fallbacks_total{endpoint, reason}` and `ace_skips_total{endpoint, reason}`: the record's free-text reason
  reduced to a fixed set of labels (`reason_class`), so the series stay bounded.

Across processes (uvicorn workers, Celery workers): prometheus_client's multiprocess mode. With
PROMETHEUS_MULTIPROC_DIR set before this module is imported, every process writes its samples to files in that
directory and /metrics (ace.ops) sums them; without it (one process, the tests) the values live in REGISTRY.
This module imports prometheus_client only (no Django), so any process can feed it.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, values

if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    # Files are named per process; containers sharing the directory (docker-compose's `metrics` volume) reuse
    # the same small pids, so the host name is part of the name (distinct per container, as the rule requires).
    _HOST = socket.gethostname().replace("_", "-")
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: f"{_HOST}-{os.getpid()}")

REGISTRY = CollectorRegistry(auto_describe=True)

PASSTHROUGH = "passthrough"

REQUESTS = Counter(
    "ace_requests",
    "Gateway requests by endpoint, mode and stage action (passthrough: no speculation on the request path).",
    ["endpoint", "mode", "action"],
    registry=REGISTRY,
)
ACCEPTANCE = Histogram(
    "ace_acceptance_rate",
    "Per-request draft acceptance rate (accepted / drafted tokens); prod measured, shadow replayed.",
    ["endpoint", "mode"],
    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
    registry=REGISTRY,
)
MEAN_ACCEPTED = Histogram(
    "ace_mean_accepted_length",
    "Per-request mean accepted length (tokens per target pass, the bonus token included).",
    ["endpoint", "mode"],
    buckets=(1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 9.0),
    registry=REGISTRY,
)
MULTIPLIER = Histogram(
    "ace_multiplier",
    "Per-request tok/s multiplier over the baseline (prod: measured; shadow: projected).",
    ["endpoint", "mode"],
    buckets=(0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0),
    registry=REGISTRY,
)
DRAFTED = Counter(
    "ace_drafted_tokens", "Draft tokens proposed (stage records).", ["endpoint", "mode"], registry=REGISTRY
)
ACCEPTED = Counter(
    "ace_accepted_tokens", "Draft tokens accepted (stage records).", ["endpoint", "mode"], registry=REGISTRY
)
OUTPUT_TOKENS = Counter(
    "ace_output_tokens", "Output tokens of requests with a stage record.", ["endpoint", "mode"], registry=REGISTRY
)
FALLBACKS = Counter(
    "ace_fallbacks",
    "Prod requests answered plainly after the speculative path failed.",
    ["endpoint", "reason"],
    registry=REGISTRY,
)
SKIPS = Counter(
    "ace_skips",
    "Prod requests sent plain because prod cannot serve them exactly.",
    ["endpoint", "reason"],
    registry=REGISTRY,
)
RECORD_WRITE_FAILURES = Counter(
    "ace_stage_record_write_failures",
    "Stage records that could not be written (logged with the request id).",
    registry=REGISTRY,
)
RECORDS_DROPPED = Counter(
    "ace_stage_records_dropped",
    "Stage records dropped because the web process's write queue was full (ACE_RECORD_QUEUE); their requests "
    "still count in ace_requests_total.",
    registry=REGISTRY,
)

# (label, pattern) in order; the first pattern found in the reason names it. Anything else is "other".
FALLBACK_REASONS: tuple[tuple[str, str], ...] = (
    ("client_gone", r"client went away|client disconnected|cancel"),
    ("redis_unavailable", r"redis unavailable"),
    ("redis_failed", r"redis failed"),
    ("enqueue_failed", r"could not enqueue"),
    ("no_worker", r"no worker on "),
    ("worker_timeout", r"worker sent nothing"),
    ("tokenize_failed", r"tokenize failed"),
    ("draft_error", r"draft error"),
    ("path_unavailable", r"no tokenizer in the worker|target_path|path .*unavailable"),
    ("worker_error", r"speculative path failed|worker error"),
    ("upstream_error", r"HTTP \d{3}|endpoint stream broke|unreachable"),
)
SKIP_REASONS: tuple[tuple[str, str], ...] = (
    ("n_gt_1", r"\bn > 1"),
    ("logprobs", r"logprobs requested"),
    ("unsupported_parameter", r"unsupported parameter"),
    ("invalid_request", r"is not a number|is not an integer|is not -1|outside|< 0|must be|invalid"),
    ("sampled", r"temperature|top_p|top_k|sampl"),
    ("batched_prompts", r"batch of prompts"),
    ("too_long", r"too long"),
    ("no_path", r"no verification path"),
    ("worker_at_capacity", r"at capacity"),
)
REASON_LABELS = {
    "fell_back": tuple(label for label, _ in FALLBACK_REASONS) + ("other",),
    "skipped": tuple(label for label, _ in SKIP_REASONS) + ("other",),
}
_COMPILED = {
    "fell_back": [(label, re.compile(pattern, re.IGNORECASE)) for label, pattern in FALLBACK_REASONS],
    "skipped": [(label, re.compile(pattern, re.IGNORECASE)) for label, pattern in SKIP_REASONS],
}


def reason_class(action: str, reason: str) -> str:
    """A label from REASON_LABELS[action] for a record's free-text reason (never the text itself)."""
    for label, pattern in _COMPILED.get(action, ()):
        if pattern.search(reason or ""):
            return label
    return "other"


def count_passthrough(*, endpoint: str, mode: str) -> None:
    """The gateway answered with the server's own response (off, shadow)."""
    REQUESTS.labels(endpoint=endpoint, mode=mode, action=PASSTHROUGH).inc()


def observe_record(*, endpoint: str, mode: str, action: str, fields: dict[str, Any]) -> None:
    """One stage record (written or not): its request, its figures, and its reason class."""
    REQUESTS.labels(endpoint=endpoint, mode=mode, action=action).inc()
    reason = str(fields.get("reason") or "")
    if action == "fell_back":
        FALLBACKS.labels(endpoint=endpoint, reason=reason_class(action, reason)).inc()
    elif action == "skipped":
        SKIPS.labels(endpoint=endpoint, reason=reason_class(action, reason)).inc()
    series = {"endpoint": endpoint, "mode": mode}
    for histogram, name in (
        (ACCEPTANCE, "acceptance_rate"),
        (MEAN_ACCEPTED, "mean_accepted_len"),
        (MULTIPLIER, "multiplier"),
    ):
        value = _number(fields.get(name))
        if value is not None:
            histogram.labels(**series).observe(value)
    for counter, name in ((DRAFTED, "drafted_tokens"), (ACCEPTED, "accepted_tokens"), (OUTPUT_TOKENS, "output_tokens")):
        value = _number(fields.get(name))
        if value:
            counter.labels(**series).inc(value)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if value != value or value in (float("inf"), float("-inf")):  # NaN / infinite: not observable
        return None
    return float(value)
