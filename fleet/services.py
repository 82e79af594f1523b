"""Fleet writes: register, change and remove endpoints, and ask for probes.

Every input is validated here, so the pages, the REST API and any script get the same rules and the same
messages. Errors are raised as one `django.core.exceptions.ValidationError` keyed by field name, and
nothing is saved when any field is wrong.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from fleet import selectors
from fleet.models import Endpoint, Probe, ServerKind
from fleet.netpolicy import URLNotAllowed, check_url

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, Group

logger = logging.getLogger(__name__)

SLUG_RE = re.compile(r"^[a-z0-9](?:[a-z0-9_-]{0,62}[a-z0-9])?$")
NODE_CLASS_RE = re.compile(r"^[a-z0-9](?:[a-z0-9_-]{0,62}[a-z0-9])?$")
API_KEY_MAX_LEN = 4096
# Printable ASCII without spaces: the key goes into an HTTP header, so control characters are refused.
API_KEY_RE = re.compile(r"^[\x21-\x7e]+$")
# "Leave this field alone" for arguments where None is a value.
UNCHANGED = object()
# Fields whose change makes the last probe stale.
_PROBE_RELEVANT = ("base_url", "kind", "api_key")


def _validate_name(
    name: str, *, exclude_pk: int | None = None, owner_id: int | None = None, team_id: int | None = None
) -> str:
    name = (name or "").strip()
    if not name:
        raise ValidationError("A name is required.")
    if not SLUG_RE.fullmatch(name):
        raise ValidationError(
            "Use 1-64 lowercase letters, digits, '-' or '_', starting and ending with a letter or digit."
        )
    others = Endpoint.objects.exclude(pk=exclude_pk) if exclude_pk is not None else Endpoint.objects.all()
    if others.filter(name=name).exists():
        raise ValidationError(f"An endpoint named {name!r} already exists.")
    # Names and served model ids are one namespace for the gateway: a name equal to the served model id of an
    # endpoint of the same owner or team would take that model's traffic (prompts included). Another tenant's
    # endpoints are no concern of the gateway's for this caller (speculation.gateway.routes.resolve), nor named.
    peers = selectors.routing_peers(owner_id=owner_id, team_id=team_id, exclude_pk=exclude_pk)
    shadowed = peers.filter(served_model=name).first()
    if shadowed is not None:
        raise ValidationError(
            f"{name!r} is the model id served by {selectors.peer_label(shadowed, team_id=team_id)}: the gateway "
            "routes model names to exactly one endpoint, so choose another name."
        )
    return name


V1_SUFFIX = "/v1"


def normalise_base_url(base_url: str) -> tuple[str, str]:
    """The base URL without a trailing "/v1" (ACE adds it itself), and a sentence saying so ("" when unchanged)."""
    url = (base_url or "").strip()
    stripped = url.rstrip("/")
    if stripped.lower().endswith(V1_SUFFIX) and "://" in stripped and stripped.count("/") > 2:
        url = stripped[: -len(V1_SUFFIX)]
        return url, f"The trailing /v1 was removed from the base URL ({url}): ACE adds /v1/... itself."
    return url, ""


def _peers_of(owner: AbstractBaseUser | None, team: Group | None) -> dict[str, int | None]:
    """The owner and team a name is checked against (fleet.selectors.routing_peers)."""
    return {"owner_id": owner.pk if owner is not None else None, "team_id": team.pk if team is not None else None}


def _validate_base_url(base_url: str) -> str:
    base_url, _ = normalise_base_url(base_url)
    if not base_url:
        raise ValidationError("A base URL is required.")
    if len(base_url) > Endpoint._meta.get_field("base_url").max_length:
        raise ValidationError("The base URL is too long.")
    try:
        return check_url(base_url)
    except URLNotAllowed as exc:
        raise ValidationError(f"This URL is not allowed: {exc}.") from exc


def _validate_kind(kind: str) -> str:
    if kind not in ServerKind.values:
        raise ValidationError(f"Unknown server kind {kind!r}: choose one of {', '.join(ServerKind.values)}.")
    return kind


def _validate_node_class(node_class: str) -> str:
    node_class = (node_class or "").strip()
    if not NODE_CLASS_RE.fullmatch(node_class):
        raise ValidationError("Use 1-64 lowercase letters, digits, '-' or '_' (it names the queue gpu.<node class>).")
    return node_class


def _validate_api_key(api_key: str) -> str:
    if len(api_key) > API_KEY_MAX_LEN:
        raise ValidationError(f"The API key is longer than {API_KEY_MAX_LEN} characters.")
    if not API_KEY_RE.fullmatch(api_key):
        raise ValidationError("The API key may only hold printable characters without spaces.")
    return api_key


def _collect(checks: dict[str, tuple]) -> dict:
    """Run every field check, gather all messages at once, and raise them together keyed by field."""
    cleaned: dict = {}
    errors: dict[str, list[str]] = {}
    for field, (check, value, kwargs) in checks.items():
        try:
            cleaned[field] = check(value, **kwargs)
        except ValidationError as exc:
            errors[field] = exc.messages
    if errors:
        raise ValidationError(errors)
    return cleaned


def _start_probe(endpoint: Endpoint) -> Probe:
    # Imported lazily: probing pulls in the adapters and the Celery app, which the models must not need.
    from fleet.tasks import start_probe

    return start_probe(endpoint)


def create_endpoint(
    *,
    name: str,
    base_url: str,
    kind: str = ServerKind.VLLM,
    node_class: str | None = None,
    api_key: str = "",
    created_by: AbstractBaseUser | None = None,
    team: Group | None = None,
) -> Endpoint:
    """Register an endpoint and queue its first probe (sent to the worker when the transaction commits).

    Its owner is the user who registers it; `team` (a Django group) lets the team's members operate it too.
    """
    owner = created_by if created_by is not None and created_by.is_authenticated else None
    checks: dict[str, tuple] = {
        "name": (_validate_name, name, _peers_of(owner, team)),
        "base_url": (_validate_base_url, base_url, {}),
        "kind": (_validate_kind, kind, {}),
        "node_class": (_validate_node_class, node_class or settings.DEFAULT_NODE_CLASS, {}),
    }
    if api_key:
        checks["api_key"] = (_validate_api_key, api_key, {})
    cleaned = _collect(checks)
    endpoint = Endpoint(
        name=cleaned["name"],
        base_url=cleaned["base_url"],
        kind=cleaned["kind"],
        node_class=cleaned["node_class"],
        created_by=created_by if created_by is not None and created_by.is_authenticated else None,
        team=team,
    )
    endpoint.owner = endpoint.created_by
    endpoint.api_key = cleaned.get("api_key", "")
    try:
        with transaction.atomic():
            endpoint.save()
            _start_probe(endpoint)
    except IntegrityError as exc:
        # Two registrations raced past the uniqueness check: report it like the check would have.
        raise ValidationError({"name": [f"An endpoint named {endpoint.name!r} already exists."]}) from exc
    logger.info(
        "endpoint %s registered (%s, %s, node class %s)",
        endpoint.name,
        endpoint.kind,
        endpoint.base_url,
        endpoint.node_class,
    )
    return endpoint


def update_endpoint(
    *,
    endpoint: Endpoint,
    name: str | None = None,
    base_url: str | None = None,
    kind: str | None = None,
    node_class: str | None = None,
    api_key: str | None = None,
    clear_api_key: bool = False,
    team: Group | None | object = UNCHANGED,
) -> Endpoint:
    """Change the given fields (None leaves a field alone); re-probe when what probing depends on changed.

    `api_key=None` keeps the stored key, a non-empty string replaces it, `clear_api_key=True` removes it.
    A new base URL needs the key again (or `clear_api_key`): the stored key is never sent to another server.
    `team` (a group, or None for no team) is left alone unless given.
    """
    checks: dict[str, tuple] = {}
    if name is not None:
        new_team = endpoint.team if team is UNCHANGED else team
        checks["name"] = (_validate_name, name, {"exclude_pk": endpoint.pk, **_peers_of(endpoint.owner, new_team)})
    if base_url is not None:
        checks["base_url"] = (_validate_base_url, base_url, {})
    if kind is not None:
        checks["kind"] = (_validate_kind, kind, {})
    if node_class is not None:
        checks["node_class"] = (_validate_node_class, node_class, {})
    if api_key and not clear_api_key:
        checks["api_key"] = (_validate_api_key, api_key, {})
    cleaned = _collect(checks)
    moved = "base_url" in cleaned and cleaned["base_url"] != endpoint.base_url
    if hasattr(endpoint, "managed"):  # fleet.managed: ACE runs the server and sets its URL itself
        fixed = [f for f in ("base_url", "kind") if f in cleaned and cleaned[f] != getattr(endpoint, f)]
        if fixed:
            raise ValidationError({f: ["set by ACE on a managed endpoint (it runs the server)"] for f in fixed})
    if moved and endpoint.has_api_key and not clear_api_key and "api_key" not in cleaned:
        raise ValidationError(
            {
                "api_key": [
                    "The base URL changes: enter the API key again (or clear the stored key). The stored key is "
                    "never sent to a different URL."
                ]
            }
        )

    changed: list[str] = []
    if team is not UNCHANGED and endpoint.team != team:
        endpoint.team = team  # type: ignore[assignment]
        changed.append("team")
    for field in ("name", "base_url", "kind", "node_class"):
        if field in cleaned and getattr(endpoint, field) != cleaned[field]:
            setattr(endpoint, field, cleaned[field])
            changed.append(field)
    if clear_api_key and endpoint.has_api_key:
        endpoint.api_key = ""
        changed.append("api_key")
    elif "api_key" in cleaned and cleaned["api_key"] != endpoint.api_key:
        endpoint.api_key = cleaned["api_key"]
        changed.append("api_key")

    if not changed:
        return endpoint
    try:
        with transaction.atomic():
            endpoint.save()
            if any(field in _PROBE_RELEVANT for field in changed):
                _start_probe(endpoint)
    except IntegrityError as exc:
        raise ValidationError({"name": [f"An endpoint named {endpoint.name!r} already exists."]}) from exc
    # Field names only: the values may include the key.
    logger.info("endpoint %s updated: %s", endpoint.name, ", ".join(changed))
    return endpoint


def delete_endpoint(*, endpoint: Endpoint) -> None:
    """Remove an endpoint with its probe history (and, by cascade, its stage records and policy)."""
    name = endpoint.name
    with transaction.atomic():
        endpoint.delete()
    logger.info("endpoint %s deleted", name)


def reprobe_endpoint(*, endpoint: Endpoint) -> Probe:
    """Queue a fresh probe of an endpoint now."""
    with transaction.atomic():
        probe = _start_probe(endpoint)
    logger.info("endpoint %s: re-probe %s queued", endpoint.name, probe.pk)
    return probe
