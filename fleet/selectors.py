"""Fleet reads: the querysets and view-ready shapes the pages and the API show."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib.auth.models import Group
from django.db.models import OuterRef, Q, QuerySet, Subquery
from django.shortcuts import get_object_or_404

from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus

# Statuses after which nothing more will arrive without a new probe: the page stops polling.
SETTLED_PROBE_STATUSES = (ProbeStatus.DONE,)
PENDING_ENDPOINT_STATUSES = (EndpointStatus.NEW, EndpointStatus.PROBING)

# How capability keys read on the page; unknown keys fall back to their name with spaces.
CAPABILITY_LABELS = {
    "served_model": "Served model",
    "models": "Served models",
    "max_context": "Max context (tokens)",
    "server_kind": "Server kind (detected)",
    "server_version": "Server version",
    "tokenize": "Tokenize",
    "detokenize": "Detokenize",
    "detokenize_roundtrip": "Detokenize round-trips the canary",
    "token_id_prompts": "Token-id prompts",
    "prompt_scoring": "Prompt scoring",
    "prompt_scoring_method": "Prompt scoring method",
    "max_logprobs": "Largest logprobs count accepted",
    "tokenizer_fingerprint": "Tokenizer fingerprint",
    "canary_token_ids": "Canary token ids",
    "canary_version": "Canary version",
    "canary_reference": "Served model's answers on the canary (a local target must reproduce them)",
    "native_speculation": "Native speculative decoding",
    "native_speculation_method": "Native speculation method",
    "native_speculation_k": "Native speculation K",
    "native_speculation_source": "Native speculation found via",
    "native_speculation_details": "Native speculation details",
    "ttft_ms": "Time to first token (ms)",
    "tpot_ms": "Time per output token (ms)",
    "latency_output_tokens": "Output tokens timed",
}
# Long values shown as a summary rather than in full.
SUMMARISED_CAPABILITIES = {"canary_token_ids", "canary_reference"}


@dataclass(frozen=True)
class CapabilityRow:
    key: str
    label: str
    value: str


def endpoint_list(*, status: str | None = None, kind: str | None = None) -> QuerySet[Endpoint]:
    """Endpoints with their latest probe's status and outcome annotated (one query, no N+1)."""
    latest = Probe.objects.filter(endpoint=OuterRef("pk")).order_by("-created_at", "-id")
    qs = Endpoint.objects.annotate(
        last_probe_id=Subquery(latest.values("id")[:1]),
        last_probe_status=Subquery(latest.values("status")[:1]),
        last_probe_outcome=Subquery(latest.values("outcome")[:1]),
        last_probe_duration_ms=Subquery(latest.values("duration_ms")[:1]),
    ).order_by("name")
    if status:
        qs = qs.filter(status=status)
    if kind:
        qs = qs.filter(kind=kind)
    return qs


def endpoint_get(*, pk: int) -> Endpoint:
    """The endpoint or Http404."""
    return get_object_or_404(Endpoint, pk=pk)


def routing_peers(*, owner_id: int | None, team_id: int | None, exclude_pk: int | None = None) -> QuerySet[Endpoint]:
    """The endpoints a model id of an endpoint with this owner and team may be confused with: its owner's own and
    its owner's teams', and its team's (neither: the other endpoints with neither). The gateway resolves a model id
    among the caller's own and its teams' endpoints first (speculation.gateway.routes.resolve), so another tenant's
    endpoint never conflicts with it."""
    if owner_id is None and team_id is None:
        peers = Q(owner__isnull=True, team__isnull=True)
    else:
        peers = Q(pk__in=[])
        if owner_id is not None:
            peers |= Q(owner_id=owner_id) | Q(team__in=Group.objects.filter(user__pk=owner_id))
        if team_id is not None:
            peers |= Q(team_id=team_id)
    return Endpoint.objects.filter(peers).exclude(pk=exclude_pk)


def peer_label(other: Endpoint, *, team_id: int | None) -> str:
    """How a message to whoever sees an endpoint of `team_id` names a peer: by name when every one of them may see
    it (no team: its owner and admins, who see every peer; a team: the team's peers), else neutrally."""
    if team_id is None or other.team_id == team_id:
        return f"endpoint {other.name!r}"
    return "another endpoint of its owner"


def served_model_conflict(*, endpoint: Endpoint, served_model: str) -> str:
    """Why the gateway cannot route `served_model` to this endpoint alone among its peers ("" when it can).

    Names and served model ids are one namespace: the id may be a peer's name, or served by a peer too. Either way
    the gateway routes the id to no endpoint of the peers (each stays reachable by its own name). The text is
    stored on the endpoint, so it names only what everyone who sees the endpoint may see.
    """
    if not served_model:
        return ""
    peers = routing_peers(owner_id=endpoint.owner_id, team_id=endpoint.team_id, exclude_pk=endpoint.pk)
    named = peers.filter(name=served_model).first()
    if named is not None:
        label = peer_label(named, team_id=endpoint.team_id)
        return (
            f"the served model id {served_model!r} is the name of {label}: requests for it go there, never here; "
            "call this endpoint by its own name"
        )
    also = peers.filter(served_model=served_model).first()
    if also is not None:
        return (
            f"{peer_label(also, team_id=endpoint.team_id)} serves the same model id {served_model!r}: the gateway "
            "routes that id to neither; call each endpoint by its own name"
        )
    return ""


def probe_list(*, endpoint: Endpoint | None = None, status: str | None = None) -> QuerySet[Probe]:
    qs = Probe.objects.select_related("endpoint").order_by("-created_at", "-id")
    if endpoint is not None:
        qs = qs.filter(endpoint=endpoint)
    if status:
        qs = qs.filter(status=status)
    return qs


UNDECRYPTABLE_KEY = "(set, but cannot be decrypted: was ACE_ENCRYPTION_KEY changed?)"


def masked_api_key(*, endpoint: Endpoint) -> str:
    """What may be shown of an endpoint's key: "" when none, a mask otherwise; never the key itself."""
    if not endpoint.has_api_key:
        return ""
    try:
        return endpoint.api_key_masked
    except ValueError:  # encrypted with another key: say so instead of failing the page
        return UNDECRYPTABLE_KEY


def endpoint_is_pending(*, endpoint: Endpoint) -> bool:
    """True while a probe is queued or running (or none has run yet): the page keeps polling."""
    if endpoint.status in PENDING_ENDPOINT_STATUSES:
        return True
    return endpoint.probes.exclude(status__in=SETTLED_PROBE_STATUSES).exists()


PROBE_HISTORY_LENGTH = 20


def endpoint_detail(*, endpoint: Endpoint) -> dict[str, Any]:
    """What an endpoint's detail page shows of it: masked key, capabilities, recent probes, probe in progress
    (the fleet page, the status panel it polls, and the speculation page's server view)."""
    probes = list(probe_list(endpoint=endpoint)[:PROBE_HISTORY_LENGTH])
    return {
        "endpoint": endpoint,
        "api_key_masked": masked_api_key(endpoint=endpoint),
        "capability_rows": capability_rows(endpoint.capabilities),
        "probes": probes,
        "latest_probe": probes[0] if probes else None,
        "pending": endpoint_is_pending(endpoint=endpoint),
    }


def any_endpoint_pending() -> bool:
    return (
        Endpoint.objects.filter(status__in=PENDING_ENDPOINT_STATUSES).exists()
        or Probe.objects.exclude(status__in=SETTLED_PROBE_STATUSES).exists()
    )


def _format_value(value: Any) -> str:
    if value is None or value == "":
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list | tuple):
        return ", ".join(_format_value(v) for v in value) if value else "none"
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_format_value(v)}" for k, v in value.items()) if value else "—"
    return str(value)


def _summarise(value: Any) -> str:
    if isinstance(value, dict) and isinstance(value.get("token_ids"), list):  # canary_reference
        greedy = len(value["token_ids"]) - int(value.get("prompt_len") or 0)
        top = value.get("top_logprobs")
        if not top:
            why = value.get("greedy_only") or "no log-probabilities"
            return f"greedy continuation of {greedy} tokens alone ({why})"
        width = max((len(p) for p in top if p), default=0)
        return f"greedy continuation of {greedy} tokens; top {width} log-probabilities at {len(top) - 1} positions"
    if isinstance(value, list | tuple):
        return f"{len(value)} ids: {_format_value(list(value[:8]))}{' …' if len(value) > 8 else ''}"
    return _format_value(value)


def capability_rows(capabilities: dict[str, Any] | None) -> list[CapabilityRow]:
    """The capabilities found by a probe as labelled, readable rows: known keys first, in a fixed order."""
    capabilities = capabilities or {}
    order = {key: i for i, key in enumerate(CAPABILITY_LABELS)}
    keys = sorted(capabilities, key=lambda k: (order.get(k, len(order)), k))
    return [
        CapabilityRow(
            key=key,
            label=CAPABILITY_LABELS.get(key, key.replace("_", " ").capitalize()),
            value=_summarise(capabilities[key]) if key in SUMMARISED_CAPABILITIES else _format_value(capabilities[key]),
        )
        for key in keys
    ]
