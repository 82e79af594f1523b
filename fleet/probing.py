"""Probing service: queue a probe of an endpoint, run it, and record what it found on the Probe and the Endpoint.

`start_probe` is called from views, the API and beat; `run_probe` from the Celery task (`fleet.tasks`).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from fleet.adapters import CANARY_TEXT, FailureKind, ProbeError, ProbeReport, get_adapter
from fleet.adapters import fingerprint as fingerprint_token_ids
from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus
from fleet.selectors import served_model_conflict

logger = logging.getLogger(__name__)

# Re-exported for callers that fingerprint a local tokenizer the way the probe does (with special tokens):
# fingerprint_token_ids(tokenizer(CANARY_TEXT, add_special_tokens=True)["input_ids"]).
__all__ = ["CANARY_TEXT", "fingerprint_token_ids", "reprobe_all", "run_probe", "start_probe", "summarize"]

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
ENQUEUE_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}


def start_probe(endpoint: Endpoint) -> Probe:
    """Create a queued Probe and enqueue the probe task once the surrounding transaction commits."""
    probe = Probe.objects.create(endpoint=endpoint, status=ProbeStatus.QUEUED)
    if endpoint.status == EndpointStatus.NEW:
        Endpoint.objects.filter(pk=endpoint.pk, status=EndpointStatus.NEW).update(status=EndpointStatus.PROBING)
        endpoint.status = EndpointStatus.PROBING
    transaction.on_commit(lambda: _enqueue(probe.pk))
    return probe


def _enqueue(probe_id: int) -> None:
    from fleet.tasks import probe_endpoint_task

    try:
        probe_endpoint_task.apply_async(
            args=[probe_id], queue=settings.CONTROL_QUEUE, retry=True, retry_policy=ENQUEUE_RETRY_POLICY
        )
    except Exception as exc:  # the broker is down: the probe is a result too, not a 500
        logger.warning("could not queue probe %s: %s", probe_id, exc)
        now = timezone.now()
        Probe.objects.filter(pk=probe_id, status=ProbeStatus.QUEUED).update(
            status=ProbeStatus.DONE,
            outcome=EndpointStatus.ERROR,
            reason=f"could not queue the probe: the task broker is unreachable ({type(exc).__name__})",
            errors=[{"step": "queue", "kind": "broker_unreachable", "message": str(exc)[:300]}],
            finished_at=now,
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
    conflict = served_model_conflict(endpoint_id=endpoint.pk, served_model=_served_model(report)) if report.ok else ""
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


def reprobe_all() -> int:
    """Queue a probe of every endpoint that has none pending; returns how many were queued.

    A probe still queued or running after two intervals was lost (worker or broker gone): it is closed as an
    error so that it does not stay pending forever, and the endpoint is probed again.
    """
    stale_before = timezone.now() - timedelta(seconds=2 * settings.PROBE_INTERVAL_S)
    pending = [ProbeStatus.QUEUED, ProbeStatus.RUNNING]
    Probe.objects.filter(status__in=pending, created_at__lt=stale_before).update(
        status=ProbeStatus.DONE,
        outcome=EndpointStatus.ERROR,
        reason="lost: the probe was never finished (worker or broker gone?)",
        finished_at=timezone.now(),
    )
    queued = 0
    for endpoint in Endpoint.objects.exclude(probes__status__in=pending):
        with transaction.atomic():
            start_probe(endpoint)
        queued += 1
    return queued
