"""Managed endpoint writes: register one, and turn a policy change that changes the server into a switch.

Registration validates everything the web process can check (name, node class, model directory under the
model roots, served name, server arguments) and saves the Endpoint and its ManagedServer together; the
supervisor of the node class starts the server and probes it (fleet.managed.supervisor). A policy change
whose speculation differs from what the server runs is not applied at once: it becomes a Switch, applied by
the supervisor in one transaction with the route move once the new instance serves (fleet.managed.switching).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import Q

from fleet import selectors as fleet_selectors
from fleet import services as fleet_services
from fleet.managed import canary
from fleet.managed.args import ServerArgsError, validate_server_args
from fleet.managed.models import NOT_STARTED_URL, ManagedKind, ManagedServer, ServerEvent, Switch, SwitchStatus
from fleet.models import Endpoint, EndpointStatus

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, Group

    from speculation.models import SpeculationPolicy

logger = logging.getLogger(__name__)

VLLM_PER_REQUEST_METRICS = ("--per-request-spec-decode-metrics", "summary")
SERVED_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,254}$")


def _validate_kind(kind: str) -> str:
    if kind not in ManagedKind.values:
        raise ValidationError(f"ACE runs {', '.join(ManagedKind.values)} servers, not {kind!r}.")
    return kind


def _validate_model_dir(model_dir: str) -> str:
    from speculation.services import model_files

    try:
        directory = model_files.under_roots(model_dir, field="model_dir")
    except ValidationError as exc:
        raise ValidationError(exc.message_dict["model_dir"]) from exc
    if not directory.is_dir():
        raise ValidationError(f"{directory} is not a directory on this node.")
    if not (directory / "config.json").is_file():
        raise ValidationError(f"{directory} holds no config.json: not a model directory.")
    return str(directory)


def _validate_served_name(served_name: str, *, owner_id: int | None = None, team_id: int | None = None) -> str:
    served_name = (served_name or "").strip()
    if not SERVED_NAME_RE.fullmatch(served_name):
        raise ValidationError("Use 1-255 letters, digits, '.', '_', '-', '/' or ':' (the model id clients send).")
    # Within the owner's and the team's endpoints only: the gateway resolves a model id among the caller's own first.
    peers = fleet_selectors.routing_peers(owner_id=owner_id, team_id=team_id)
    clash = peers.filter(Q(served_model=served_name) | Q(managed__served_name=served_name)).first()
    if clash is not None:
        raise ValidationError(
            f"{served_name!r} is already served by {fleet_selectors.peer_label(clash, team_id=team_id)}."
        )
    return served_name


def _validate_args(server_args: Any) -> dict[str, Any]:
    try:
        return validate_server_args(server_args if server_args is not None else {})
    except ServerArgsError as exc:
        raise ValidationError([f"{name}: {why}" for name, why in exc.errors.items()]) from exc


def create_managed_endpoint(
    *,
    name: str,
    model_dir: str,
    served_name: str = "",
    kind: str = ManagedKind.VLLM,
    node_class: str | None = None,
    server_args: dict[str, Any] | None = None,
    created_by: AbstractBaseUser | None = None,
    team: Group | None = None,
) -> Endpoint:
    """Register an endpoint whose server ACE runs; the node class's supervisor starts it."""
    user = created_by if created_by is not None and created_by.is_authenticated else None
    peers = fleet_services._peers_of(user, team)
    checks: dict[str, tuple] = {
        "name": (fleet_services._validate_name, name, peers),
        "kind": (_validate_kind, kind, {}),
        "node_class": (fleet_services._validate_node_class, node_class or settings.DEFAULT_NODE_CLASS, {}),
        "model_dir": (_validate_model_dir, model_dir, {}),
        "served_name": (_validate_served_name, served_name or name, peers),
        "server_args": (_validate_args, server_args, {}),
    }
    cleaned = fleet_services._collect(checks)
    endpoint = Endpoint(
        name=cleaned["name"],
        base_url=NOT_STARTED_URL,
        kind=cleaned["kind"],
        node_class=cleaned["node_class"],
        created_by=user,
        owner=user,
        team=team,
        status=EndpointStatus.NEW,
        status_reason="managed: waiting for the supervisor of node class " + cleaned["node_class"],
    )
    try:
        with transaction.atomic():
            endpoint.save()
            ManagedServer.objects.create(
                endpoint=endpoint,
                server_kind=cleaned["kind"],
                model_dir=cleaned["model_dir"],
                served_name=cleaned["served_name"],
                server_args=cleaned["server_args"],
            )
    except IntegrityError as exc:
        raise ValidationError({"name": [f"An endpoint named {endpoint.name!r} already exists."]}) from exc
    logger.info("managed endpoint %s registered (%s, %s)", endpoint.name, endpoint.kind, cleaned["model_dir"])
    return endpoint


def managed_of(endpoint: Endpoint) -> ManagedServer | None:
    return ManagedServer.objects.filter(endpoint_id=endpoint.pk).first()


# --- policy changes ---------------------------------------------------------------------------------------------


def ace_speculates(policy: SpeculationPolicy) -> bool:
    """Prod with path local or remote: ACE speculates itself against the server, which runs plain."""
    from speculation.models import Mode, VerificationPath

    return policy.mode == Mode.PROD and policy.path in (VerificationPath.LOCAL, VerificationPath.REMOTE)


def speculation_of(policy: SpeculationPolicy) -> dict[str, Any]:
    """What the server must run for this policy: {} (off, shadow, and prod on ACE's own local or remote path) or
    the draft kind, its path and K (prod on path auto or native: the server's own speculation)."""
    from speculation.models import Mechanism, Mode

    if policy.mode != Mode.PROD or ace_speculates(policy):
        return {}
    if policy.mechanism in (Mechanism.NGRAM, Mechanism.SUFFIX):
        return {"draft_kind": str(policy.mechanism), "draft_path": "", "k": int(policy.k)}
    draft = policy.draft
    speculation = {
        "draft_kind": draft.kind if draft else policy.mechanism,
        "draft_path": draft.path if draft else "",
        "k": int(policy.k),
    }
    if policy.mechanism == Mechanism.EAGLE_HEAD and policy.eagle_tree:
        from speculation.selectors.native_flags import drafts_trees

        if drafts_trees(policy.endpoint.kind):  # else no tree setting: never a switch for nothing
            speculation["tree"] = dict(policy.eagle_tree)
    return speculation


def spec_args(*, server_kind: str, speculation: dict[str, Any]) -> list[str]:
    """The native launch flags for this speculation ([] for none)."""
    if not speculation:
        return []
    from speculation.selectors.native_flags import native_flags

    args = native_flags(
        server_kind=server_kind,
        draft_kind=speculation["draft_kind"],
        draft_path=speculation["draft_path"],
        k=speculation["k"],
        tree=speculation.get("tree"),
    ).args
    if server_kind == "vllm":
        # Acceptance per request in the response (metrics.speculative_decoding), never shared counter deltas.
        args = [*args, *VLLM_PER_REQUEST_METRICS]
    return args


def needs_switch(*, endpoint: Endpoint, policy: SpeculationPolicy) -> bool:
    """True when the endpoint is managed and this (unsaved) policy asks the server to run differently, or a
    switch is under way (then any change waits: request_switch refuses it, so a switch never undoes it)."""
    managed = managed_of(endpoint)
    if managed is None:
        return False
    return speculation_of(policy) != (managed.serving_speculation or {}) or _switch_running(managed)


def _switch_running(managed: ManagedServer) -> bool:
    return Switch.objects.filter(managed=managed, status__in=[SwitchStatus.PENDING, SwitchStatus.STARTING]).exists()


def _validate_for_switch(
    policy: SpeculationPolicy, endpoint: Endpoint, managed: ManagedServer, validate: Callable[..., None]
) -> None:
    from speculation.models import Mode
    from speculation.selectors.native_flags import NativeFlagsError

    # Prod on path auto or native runs the server's own speculation on the new instance: everything but the path
    # is checked as shadow checks it (fields, draft, tokenizer), then the flags must exist for this server kind.
    # Prod on path local or remote is checked as on any endpoint (the instance runs plain).
    mode = policy.mode
    if mode == Mode.PROD and not ace_speculates(policy):
        policy.mode = Mode.SHADOW
    try:
        validate(policy=policy, endpoint=endpoint)
    finally:
        policy.mode = mode
    errors: dict[str, list[str]] = {}
    if mode == Mode.PROD and endpoint.status != EndpointStatus.READY:
        errors["mode"] = [f"prod needs a ready endpoint; {endpoint.name} is {endpoint.status}"]
    try:
        spec_args(server_kind=managed.server_kind, speculation=speculation_of(policy))
    except NativeFlagsError as exc:
        errors["draft"] = [str(exc)]
    if _switch_running(managed):
        errors["mode"] = ["a switch of this managed endpoint is in progress: wait until it is done or failed"]
    if errors:
        raise ValidationError(errors)


def request_switch(
    *,
    endpoint: Endpoint,
    policy: SpeculationPolicy,
    changes: dict[str, list[Any]],
    user: AbstractBaseUser | None,
    validate: Callable[..., None],
    editable: Collection[str],
) -> Switch:
    """Queue a blue/green switch for a policy change (the policy in memory holds the new values, unsaved).

    Called inside the policy service's transaction, which passes its own check (``validate(policy=, endpoint=)``,
    raising ValidationError) and the policy fields a switch applies (``editable``): the saved policy is left as it
    is until the new instance serves. Raises ValidationError (keyed by field) when the change cannot be applied.
    """
    managed = ManagedServer.objects.select_for_update().get(endpoint_id=endpoint.pk)
    _validate_for_switch(policy, endpoint, managed, validate)
    fields = {name: getattr(policy, name) for name in editable if name != "draft"}
    fields["draft"] = policy.draft_id
    if policy.mode == "prod" and not ace_speculates(policy):
        fields["path"] = "native"  # prod on path auto: the server's own speculation on the new instance
    actor = user if user is not None and user.is_authenticated else None
    speculation = speculation_of(policy)
    switch = Switch.objects.create(
        managed=managed,
        requested_by=actor,
        fields=fields,
        changes=changes,
        speculation=speculation,
        # Whether the supervisor checks the new instance before moving the route (fleet.managed.canary).
        canary=canary.requested(settings.MANAGED_SWITCH_CANARY, speculation),
    )
    logger.info("managed endpoint %s: switch %s queued (%s)", endpoint.name, switch.pk, switch.speculation or "plain")
    return switch


def request_baseline(*, managed: ManagedServer) -> None:
    """Ask the supervisor to measure the baseline again; only a server running without speculation can."""
    if managed.serving_speculation:
        raise ValidationError(
            {"baseline": ["the server runs with speculation now: switch to off or shadow to measure its baseline"]}
        )
    ManagedServer.objects.filter(pk=managed.pk).update(baseline_requested=True)


def record_event(managed: ManagedServer, kind: str, message: str = "", **extra: Any) -> ServerEvent:
    return ServerEvent.objects.create(managed=managed, kind=kind, message=message[:4000], **extra)
