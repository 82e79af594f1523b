"""The database side of the supervisor: record a probe of an instance, move the route, apply or roll back a switch.

Each function is one transaction. The route moves atomically: the endpoint's base_url, its probe findings,
the policy fields of a switch and the instance roles change together, then the gateway's routing version is
bumped (speculation.services.version), so the next request of every gateway process goes to the new
instance while requests already streaming from the old one finish there.
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.utils import timezone

from fleet.adapters import ProbeReport
from fleet.managed import canary as canary_check
from fleet.managed.models import (
    EventKind,
    InstanceRole,
    InstanceState,
    ManagedServer,
    ServerInstance,
    Switch,
    SwitchStatus,
)
from fleet.managed.services import record_event
from fleet.models import Endpoint, Probe, ProbeStatus
from fleet.probing import summarize

logger = logging.getLogger(__name__)


def _bump() -> None:
    from speculation.services.version import bump_routing_version

    transaction.on_commit(bump_routing_version)


def _probe_row(endpoint_id: int, report: ProbeReport, duration_ms: float, started) -> Probe:
    outcome, reason = summarize(report)
    return Probe.objects.create(
        endpoint_id=endpoint_id,
        status=ProbeStatus.DONE,
        outcome=outcome,
        reason=reason,
        capabilities=report.capabilities,
        errors=report.errors,
        started_at=started,
        finished_at=timezone.now(),
        duration_ms=round(duration_ms, 3),
    )


def _route_to(instance: ServerInstance, probe: Probe, report: ProbeReport) -> None:
    """Point the endpoint at this instance, with what its probe found."""
    Endpoint.objects.filter(pk=instance.managed.endpoint_id).update(
        base_url=instance.base_url,
        status=probe.outcome,
        status_reason=f"managed instance {instance.pk} on port {instance.port}: {probe.reason}",
        capabilities=report.capabilities,
        served_model=(report.capabilities.get("served_model") or "")[:255],
        last_probed_at=probe.finished_at,
        updated_at=probe.finished_at,
    )


def activate(*, instance: ServerInstance, report: ProbeReport, duration_ms: float, started) -> None:
    """An active instance (first start or restart) serves: route the endpoint to it."""
    with transaction.atomic():
        probe = _probe_row(instance.managed.endpoint_id, report, duration_ms, started)
        ServerInstance.objects.filter(pk=instance.pk).update(state=InstanceState.READY, ready_at=timezone.now())
        ManagedServer.objects.filter(pk=instance.managed_id).update(failures=0, next_start_at=None)
        _route_to(instance, probe, report)
        record_event(instance.managed, EventKind.READY, f"serving on port {instance.port}", instance=instance)
        _bump()


def mark_down(*, managed: ManagedServer, reason: str) -> None:
    """No instance serves: the endpoint says why (the gateway answers with a clear error meanwhile)."""
    from fleet.models import EndpointStatus

    Endpoint.objects.filter(pk=managed.endpoint_id).update(
        status=EndpointStatus.UNREACHABLE, status_reason=reason[:2000], updated_at=timezone.now()
    )
    _bump()


def _apply_fields(policy, fields: dict[str, Any], changes: dict[str, list[Any]]) -> None:
    for name, value in fields.items():
        attr = "draft_id" if name == "draft" else name
        old = getattr(policy, attr)
        if old != value:
            setattr(policy, attr, value)
            if name not in changes:
                changes[name] = [old, value]


def complete_switch(
    *,
    switch: Switch,
    instance: ServerInstance,
    old: ServerInstance | None,
    report: ProbeReport,
    duration_ms: float,
    started,
    canary: dict[str, Any] | None = None,
) -> None:
    """The new instance is ready, probed and passed the canary (or needed none): apply the policy, move the
    route, set the old one draining. `canary`: the canary's record (fleet.managed.canary), kept on the switch."""
    from speculation.models import PolicyChange
    from speculation.services.policies import get_policy

    now = timezone.now()
    seconds = (now - switch.created_at).total_seconds()
    managed = instance.managed
    canary = canary if canary is not None else switch.canary
    with transaction.atomic():
        policy = get_policy(endpoint=managed.endpoint)
        changes = dict(switch.changes)
        _apply_fields(policy, switch.fields, changes)
        policy.updated_by_id = switch.requested_by_id
        policy.save()
        probe = _probe_row(managed.endpoint_id, report, duration_ms, started)
        _route_to(instance, probe, report)
        ServerInstance.objects.filter(pk=instance.pk).update(
            role=InstanceRole.ACTIVE, state=InstanceState.READY, ready_at=now
        )
        if old is not None:
            ServerInstance.objects.filter(pk=old.pk).update(role=InstanceRole.DRAINING, draining_since=now)
        ManagedServer.objects.filter(pk=managed.pk).update(serving_speculation=switch.speculation, failures=0)
        Switch.objects.filter(pk=switch.pk).update(
            status=SwitchStatus.DONE, finished_at=now, duration_s=seconds, canary=canary
        )
        outcome = {
            "outcome": "done",
            "duration_s": round(seconds, 3),
            "instance": instance.pk,
            "port": instance.port,
            "canary": canary,
        }
        PolicyChange.objects.create(
            policy=policy, changed_by_id=switch.requested_by_id, changes={**changes, "switch": outcome}
        )
        record_event(
            managed,
            EventKind.SWITCHED,
            f"switch {switch.pk} done in {seconds:.1f} s: now serving "
            f"{switch.speculation or 'without speculation'} on port {instance.port}",
            instance=instance,
        )
        _bump()
    logger.info("managed endpoint %s: switch %s done in %.1f s", managed.endpoint.name, switch.pk, seconds)


def fail_switch(
    *,
    switch: Switch,
    reason: str,
    log_tail: str = "",
    instance: ServerInstance | None = None,
    canary: dict[str, Any] | None = None,
) -> None:
    """The new instance did not serve (or failed the canary): the policy stays as it was (the change is rolled
    back), the reason kept; the endpoint keeps serving from the instance it had."""
    from speculation.models import PolicyChange
    from speculation.services.policies import get_policy

    now = timezone.now()
    seconds = (now - switch.created_at).total_seconds()
    managed = switch.managed
    canary = canary if canary is not None else switch.canary
    if canary.get("outcome") == canary_check.PENDING:
        canary = {"outcome": canary_check.NOT_RUN, "reason": "the new instance did not serve"}
    with transaction.atomic():
        Switch.objects.filter(pk=switch.pk).update(
            status=SwitchStatus.FAILED, reason=reason[:4000], finished_at=now, duration_s=seconds, canary=canary
        )
        policy = get_policy(endpoint=managed.endpoint)
        outcome = {
            "outcome": "rolled back",
            "reason": reason[:1000],
            "requested": switch.changes,
            "duration_s": round(seconds, 3),
            "canary": canary,
        }
        PolicyChange.objects.create(policy=policy, changed_by_id=switch.requested_by_id, changes={"switch": outcome})
        record_event(
            managed,
            EventKind.SWITCH_FAILED,
            f"switch {switch.pk} rolled back: {reason}",
            log_tail=log_tail[-8000:],
            instance=instance,
        )
    logger.warning("managed endpoint %s: switch %s failed: %s", managed.endpoint.name, switch.pk, reason)


def keep_baseline(*, managed: ManagedServer, instance: ServerInstance, buckets: dict[str, float]) -> None:
    """Keep a measured baseline; the gateway's routes carry it to the native path's records."""
    with transaction.atomic():
        value = {"buckets": buckets, "measured_at": timezone.now().isoformat(), "instance": instance.pk}
        ManagedServer.objects.filter(pk=managed.pk).update(baseline=value, baseline_requested=False)
        text = ", ".join(f"{c} streams: {tok_s:.1f} tok/s" for c, tok_s in buckets.items())
        record_event(managed, EventKind.BASELINE, f"baseline without speculation: {text}", instance=instance)
        _bump()
