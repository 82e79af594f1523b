"""Probing service: queue a probe of an endpoint, run it, and record what it found on the Probe and the Endpoint.

`start_probe` is called from views, the API and beat; `run_probe` from the Celery task (`fleet.tasks`).
"""

from __future__ import annotations

import logging
import time

from django.utils import timezone

from fleet.adapters import CANARY_TEXT, FailureKind, ProbeError, ProbeReport, get_adapter
from fleet.adapters import fingerprint as fingerprint_token_ids
from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus
from fleet.selectors import served_model_conflict

logger = logging.getLogger(__name__)

# Re-exported for callers that fingerprint a local tokenizer the way the probe does (with special tokens):
# fingerprint_token_ids(tokenizer(CANARY_TEXT, add_special_tokens=True)["input_ids"]).
__all__ = ["CANARY_TEXT", "fingerprint_token_ids", "run_probe", "summarize"]

# Which endpoint status a fatal probe failure leads to; everything else is "error" with its reason.
STATUS_FOR_FAILURE = {
    FailureKind.UNREACHABLE: EndpointStatus.UNREACHABLE,
    FailureKind.TIMEOUT: EndpointStatus.UNREACHABLE,
    FailureKind.UNAUTHORIZED: EndpointStatus.UNAUTHORIZED,
}
# A probe that succeeded but could not generate leaves the endpoint degraded rather than ready.
DEGRADING_STEPS = frozenset({"latency"})
PROBE_RESULT_FIELDS = (
    *("status", "outcome", "reason", "capabilities", "errors"),
    *("started_at", "finished_at", "duration_ms"),
)


def run_probe(probe_id: int) -> Probe | None:
    """Probe the endpoint of a queued Probe and record the outcome. Idempotent: a finished probe is left alone."""
    probe = Probe.objects.select_related("endpoint").filter(pk=probe_id).first()
    if probe is None:
        logger.info("probe %s no longer exists (endpoint deleted?)", probe_id)
        return None
    if probe.status == ProbeStatus.DONE:
        return probe
    endpoint = probe.endpoint
    started = timezone.now()
    Probe.objects.filter(pk=probe.pk).update(status=ProbeStatus.RUNNING, started_at=started)
    t0 = time.perf_counter()
    report = _probe_endpoint(endpoint)
    duration_ms = (time.perf_counter() - t0) * 1000
    outcome, reason = summarize(report)
    conflict = served_model_conflict(endpoint=endpoint, served_model=_served_model(report)) if report.ok else ""
    if conflict:  # routed by name only (speculation.gateway.routes); shown as a problem on the endpoint
        report.errors.append({"step": "routing", "kind": "ambiguous_model", "message": conflict})
        reason = f"{reason}; routing problem: {conflict}"
    finished = timezone.now()

    probe.status = ProbeStatus.DONE
    probe.outcome = outcome
    probe.reason = reason
    probe.capabilities = report.capabilities
    probe.errors = report.errors
    probe.started_at = started
    probe.finished_at = finished
    probe.duration_ms = round(duration_ms, 3)
    probe.save(update_fields=[*PROBE_RESULT_FIELDS])
    _record_on_endpoint(endpoint.pk, probe, report)
    logger.info("probe %s of endpoint %s: %s %s", probe.pk, endpoint.name, outcome, reason)
    return probe


def _probe_endpoint(endpoint: Endpoint) -> ProbeReport:
    try:
        adapter = get_adapter(endpoint)
    except ValueError as exc:  # an undecryptable key or an unknown kind
        error = ProbeError(FailureKind.INTERNAL, str(exc))
        return ProbeReport(errors=[error.as_record("setup")], fatal=error)
    return adapter.probe()


def summarize(report: ProbeReport) -> tuple[str, str]:
    """The endpoint status a report leads to, and the reason shown next to it."""
    if report.fatal is not None:
        status = STATUS_FOR_FAILURE.get(report.fatal.kind, EndpointStatus.ERROR)
        return status, f"{report.fatal.kind}: {report.fatal.message}"
    failed = {e["step"] for e in report.errors}
    if failed & DEGRADING_STEPS:
        return EndpointStatus.DEGRADED, "lists models but cannot generate: " + "; ".join(
            e["message"] for e in report.errors if e["step"] in DEGRADING_STEPS
        )
    if report.errors:
        return EndpointStatus.READY, f"ready; optional checks failed: {', '.join(sorted(failed))}"
    return EndpointStatus.READY, "ready"


def _record_on_endpoint(endpoint_id: int, probe: Probe, report: ProbeReport) -> None:
    fields: dict[str, object] = {
        "status": probe.outcome,
        "status_reason": probe.reason,
        "last_probed_at": probe.finished_at,
        "updated_at": probe.finished_at,
    }
    if report.ok:  # a failed probe keeps what the last good one found
        fields["capabilities"] = report.capabilities
        fields["served_model"] = _served_model(report)
    # update(), not save(): an edit made while the probe ran must not be overwritten.
    Endpoint.objects.filter(pk=endpoint_id).update(**fields)


def _served_model(report: ProbeReport) -> str:
    return (report.capabilities.get("served_model") or "")[:255]
