"""Dashboard pages: fleet overview, endpoint speculation page, projection, draft registry.

Thin: reads through speculation.selectors (rollups, options) and fleet.selectors, writes through the
policy and draft services. Chart data is embedded as JSON for the first paint and refreshed from the REST
timeseries API by static/js/dashboard.js.
"""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, HttpResponseBadRequest
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils import timezone
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from ace.query_params import finite_number
from fleet import permissions
from fleet.models import Endpoint
from fleet.permissions import endpoint_for, visible_endpoints
from speculation.engine.projection import MAX_PROJECTED_K
from speculation.selectors import costs as cost_selectors
from speculation.selectors import options, rollups
from speculation.selectors.drafts import visible_drafts
from speculation.services import autopairing as autopairing_service
from speculation.services import drafts as draft_service
from speculation.services import path_choice
from speculation.services import policies as policy_service
from speculation.web import endpoint_page as page
from speculation.web.forms import DraftRegisterForm, ModeForm, PolicyForm


def _back(request: HttpRequest, default: str) -> str:
    target = request.POST.get("next") or request.GET.get("next") or ""
    if url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}, require_https=request.is_secure()):
        return target
    return default


# --- fleet overview -----------------------------------------------------------------------------------


@login_required
@require_GET
@path_choice.remembered()
def overview(request: HttpRequest) -> HttpResponse:
    endpoints = list(visible_endpoints(request.user, Endpoint.objects.select_related("policy__draft")).order_by("name"))
    summary = rollups.fleet_summary(endpoint_ids=[e.pk for e in endpoints])
    rows = []
    for endpoint in endpoints:
        policy = page.policy_of(endpoint)
        empty = {"hour": {}, "day": {}}
        rows.append(
            {
                "endpoint": endpoint,
                "policy": policy,
                "path": options.effective_path(policy=policy, endpoint=endpoint),
                "modes": options.mode_options(policy=policy, endpoint=endpoint),
                "stats": summary.get(endpoint.pk, empty),
            }
        )
    bars = {
        "names": [r["endpoint"].name for r in rows],
        "baseline": [r["stats"]["day"].get("baseline_tok_s") for r in rows],
        "speculative": [r["stats"]["day"].get("tok_s") for r in rows],
        "multiplier": [r["stats"]["day"].get("multiplier") for r in rows],
    }
    context = {
        "rows": rows,
        "bars": bars,
        "has_prod_data": any(v is not None for v in bars["speculative"]),
        "has_records": bool(summary),
    }
    return render(request, "speculation/overview.html", context)


@login_required
@require_POST
def endpoint_mode(request: HttpRequest, pk: int) -> HttpResponse:
    """The overview's off / shadow / prod toggle."""
    endpoint = endpoint_for(request.user, pk, operate=True)
    form = ModeForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose off, shadow or prod.")
    else:
        try:
            policy_service.update_policy(endpoint=endpoint, user=request.user, mode=form.cleaned_data["mode"])
        except ValidationError as exc:
            messages.error(request, f"{endpoint.name} stays as it was: {'; '.join(exc.messages)}")
        else:
            messages.success(request, f"{endpoint.name} is now in {form.cleaned_data['mode']} mode.")
    return redirect(_back(request, reverse("speculation:overview")))


# --- endpoint page ------------------------------------------------------------------------------------


@login_required
@require_GET
def endpoint_page(request: HttpRequest, pk: int) -> HttpResponse:
    """One of the page's views (`?view=`, the overview by default): speculation.web.endpoint_page."""
    endpoint = endpoint_for(request.user, pk, queryset=Endpoint.objects.select_related("policy__draft"))
    try:
        view = page.view_of(request)
    except page.UnknownView as exc:
        return HttpResponseBadRequest(str(exc))
    return render(request, "speculation/endpoint.html", page.context(request, endpoint, view=view))


@login_required
@require_POST
def endpoint_policy(request: HttpRequest, pk: int) -> HttpResponse:
    """The settings form: every field through the policy service (validated as a whole, change recorded)."""
    endpoint = endpoint_for(request.user, pk, operate=True, queryset=Endpoint.objects.select_related("policy__draft"))
    drafts = page.drafts_offered(request, page.policy_of(endpoint))
    form = PolicyForm(request.POST, draft_names=[d.name for d in drafts])
    if form.is_valid():
        fields = dict(form.cleaned_data)
        fields["draft"] = fields["draft"] or None
        try:
            policy_service.update_policy(endpoint=endpoint, user=request.user, **fields)
        except ValidationError as exc:
            form.apply_service_errors(exc)
        else:
            messages.success(request, f"Speculation settings of {endpoint.name} saved.")
            return redirect("speculation:endpoint", pk=endpoint.pk)
    endpoint.refresh_from_db()
    context = page.context(request, endpoint, view="settings", form=form)
    return render(request, "speculation/endpoint.html", context, status=400)


@login_required
@require_POST
def endpoint_reevaluate_path(request: HttpRequest, pk: int) -> HttpResponse:
    """Choose auto's verification path again (the only way, besides a policy change, that it moves)."""
    endpoint = endpoint_for(request.user, pk, operate=True)
    try:
        policy = policy_service.reevaluate_path(endpoint=endpoint, user=request.user)
    except ValidationError as exc:
        messages.error(request, "; ".join(exc.messages))
    else:
        messages.success(request, f"Verification path of {endpoint.name}: {policy.resolved_path or 'none fits'}.")
    return redirect("speculation:endpoint", pk=endpoint.pk)


@login_required
@require_POST
def endpoint_apply_pairing(request: HttpRequest, pk: int) -> HttpResponse:
    """One click: the policy takes auto-pairing's recommendation (pooled, or the posted workload's)."""
    endpoint = endpoint_for(request.user, pk, operate=True)
    workload = request.POST.get("workload") or None
    try:
        policy, chosen = autopairing_service.apply_recommendation(
            endpoint=endpoint, user=request.user, workload=workload
        )
    except ValidationError as exc:
        messages.error(request, f"{endpoint.name} stays as it was: {'; '.join(exc.messages)}")
    else:
        messages.success(request, f"{endpoint.name} now drafts with {chosen.candidate} at K = {policy.k}.")
    return redirect(reverse("speculation:endpoint", args=[endpoint.pk]) + "?view=autopairing")


# --- projection ---------------------------------------------------------------------------------------


def _float_param(request: HttpRequest, name: str) -> float | None:
    value = finite_number(request.GET.get(name, ""))
    return value if value is not None and value >= 0 else None


@login_required
@require_GET
def projection(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = endpoint_for(request.user, pk, queryset=Endpoint.objects.select_related("policy__draft"))
    time_range = page.time_range(request)
    measured = rollups.measured_acceptance(endpoint_id=endpoint.pk, since=time_range.since(timezone.now()))
    v = _float_param(request, "v")
    what_if = cost_selectors.projection(
        endpoint=endpoint, alpha=measured.get("alpha"), c=_float_param(request, "c"), v=v if v else None
    )
    curve = what_if["curve"]
    context = {
        "endpoint": endpoint,
        "policy": page.policy_of(endpoint),
        "range": time_range,
        "ranges": list(rollups.RANGES),
        "measured": measured,
        **what_if,
        "best": next((p for p in curve if p.best), None),
        "chart": {"k": [p.k for p in curve], "s": [round(p.multiplier, 4) for p in curve]},
        "k_max": MAX_PROJECTED_K,
    }
    return render(request, "speculation/projection.html", context)


# --- drafts -------------------------------------------------------------------------------------------


@login_required
@require_http_methods(["GET", "POST"])
def draft_list(request: HttpRequest) -> HttpResponse:
    if request.method == "POST":
        permissions.require_write(request.user, "register drafts")
    form = DraftRegisterForm(request.POST or None, initial={"node_class": "cpu"}, user=request.user)
    if request.method == "POST" and form.is_valid():
        try:
            draft = draft_service.register_draft(**form.cleaned_data, owner=request.user)
        except ValidationError as exc:
            form.apply_service_errors(exc)
        else:
            messages.success(request, f"Draft {draft.name} registered.")
            return redirect("speculation:draft-list")
    drafts = list(visible_drafts(request.user))
    endpoints = list(visible_endpoints(request.user).order_by("name"))
    matrix = [
        {
            "draft": draft,
            "cells": [(e, *options.draft_compatible(draft=draft, endpoint=e)) for e in endpoints],
        }
        for draft in drafts
    ]
    status = 400 if request.method == "POST" else 200
    return render(
        request, "speculation/drafts.html", {"form": form, "matrix": matrix, "endpoints": endpoints}, status=status
    )
