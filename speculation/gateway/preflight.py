"""A prod request's preflight: whether the worker can serve it exactly, and whether the goodput guard lets it
speculate, decided before anything costs a call to the server. It returns a Plan, or the reason the request is
served plain (skipped)."""

from __future__ import annotations

from dataclasses import dataclass

from fleet.adapters import semantics_for
from speculation.gateway import goodput
from speculation.gateway import sampling as request_sampling
from speculation.gateway.call import Call
from speculation.gateway.exactness import stop_fields_reason, unservable_reason
from speculation.gateway.guard.rules import Decision
from speculation.models import VerificationPath

DEFAULT_MAX_CONTEXT = 2048


@dataclass(frozen=True)
class Plan:
    """How prod serves the request: natively (the server speculates itself), or through the worker with this
    sampling, as the guard decided."""

    native: bool = False
    sampling: request_sampling.RequestSampling | None = None
    decision: Decision | None = None


def max_context(call: Call) -> int:
    return int(call.route.capabilities.get("max_context") or DEFAULT_MAX_CONTEXT)


def expected_tokens(call: Call) -> int | None:
    """The output budget the server gives the request, before its prompt is tokenized (so at most the context): the
    length the guard's cost rule judges it by; None where the server would refuse the budget."""
    try:
        return semantics_for(call.route.kind).max_new_tokens(
            kind=call.kind, body=call.body, prompt_len=0, max_context=max_context(call)
        )
    except (TypeError, ValueError):
        return None


async def preflight(call: Call) -> Plan | str:
    route = call.route
    reason = unservable_reason(call.body, kind=call.kind)
    if reason:
        return reason
    if route.path == VerificationPath.NATIVE:
        return Plan(native=True)
    if route.path not in (VerificationPath.REMOTE, VerificationPath.LOCAL):
        return "no verification path fits this endpoint"
    sampling = request_sampling.parse(call.body)
    if isinstance(sampling, str):
        return sampling
    reason = request_sampling.path_reason(sampling, path=route.path, capabilities=route.capabilities)
    if reason:
        return reason
    reason = stop_fields_reason(call.body, kind=call.kind, path=route.path)
    if reason:
        return reason
    # before tokenizing: a request the guard sends plain costs no extra call
    decision = await goodput.decide(call, tokens=expected_tokens(call))
    if decision.plain:
        return decision.reason
    return Plan(sampling=sampling, decision=decision)
