"""Managed endpoint reads: the state shown on the endpoint page and returned by the REST API."""

from __future__ import annotations

from typing import Any

from django.conf import settings

from fleet.managed import canary
from fleet.managed.models import LIVE_STATES, ManagedServer, ServerEvent, ServerInstance, Switch, SwitchStatus
from fleet.models import Endpoint

EVENTS_SHOWN = 30
SWITCHES_SHOWN = 20


def managed_for(endpoint: Endpoint) -> ManagedServer | None:
    return ManagedServer.objects.filter(endpoint_id=endpoint.pk).first()


def _instance(i: ServerInstance) -> dict[str, Any]:
    return {
        "id": i.pk,
        "role": i.role,
        "state": i.state,
        "port": i.port,
        "pid": i.pid,
        "speculation": i.speculation,
        "started_at": i.started_at,
        "ready_at": i.ready_at,
        "stopped_at": i.stopped_at,
        "exit_code": i.exit_code,
        "reason": i.reason,
    }


def _event(e: ServerEvent) -> dict[str, Any]:
    return {
        "at": e.created_at,
        "kind": e.kind,
        "instance": e.instance_id,
        "message": e.message,
        "exit_code": e.exit_code,
        "log_tail": e.log_tail,
    }


def _switch(s: Switch) -> dict[str, Any]:
    return {
        "id": s.pk,
        "status": s.status,
        "requested_by": s.requested_by.username if s.requested_by else None,
        "requested_at": s.created_at,
        "finished_at": s.finished_at,
        "duration_s": s.duration_s,
        "speculation": s.speculation,
        "changes": s.changes,
        "reason": s.reason,
        "canary": s.canary,
    }


def canary_refusal(switches: list[Switch]) -> dict[str, Any] | None:
    """The last finished switch, when the switch canary refused it (then the endpoint stays on its instance)."""
    finished = next((s for s in switches if s.status in (SwitchStatus.DONE, SwitchStatus.FAILED)), None)
    if finished is None or finished.status != SwitchStatus.FAILED:
        return None
    if (finished.canary or {}).get("outcome") != canary.FAILED:
        return None
    return {"at": finished.finished_at, "reason": finished.reason, "speculation": finished.speculation}


def managed_state(managed: ManagedServer) -> dict[str, Any]:
    live = list(managed.instances.filter(state__in=LIVE_STATES))
    recent = list(managed.instances.all()[:10])
    switches = list(managed.switches.select_related("requested_by")[:SWITCHES_SHOWN])
    return {
        "endpoint": managed.endpoint_id,
        "server_kind": managed.server_kind,
        "model_dir": managed.model_dir,
        "served_name": managed.served_name,
        "server_args": managed.server_args,
        "serving_speculation": managed.serving_speculation,
        "failures": managed.failures,
        "baseline": managed.baseline,
        "next_start_at": managed.next_start_at,
        "live_instances": [_instance(i) for i in live],
        "recent_instances": [_instance(i) for i in recent],
        "restarts": managed.events.filter(kind="restarting").count(),
        "events": [_event(e) for e in managed.events.all()[:EVENTS_SHOWN]],
        "switches": [_switch(s) for s in switches],
        "switch_canary": settings.MANAGED_SWITCH_CANARY,
        "canary_refusal": canary_refusal(switches),
    }
