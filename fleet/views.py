"""Fleet pages. Thin: read through fleet.selectors, write through fleet.services."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from fleet import permissions, selectors, services
from fleet.forms import EndpointForm


def _visible_list(request: HttpRequest):
    endpoints = selectors.endpoint_list(status=request.GET.get("status"), kind=request.GET.get("kind"))
    return permissions.visible_endpoints(request.user, endpoints)


def _say_normalised(request: HttpRequest, base_url: str) -> None:
    notice = services.normalise_base_url(base_url)[1]
    if notice:
        messages.info(request, notice)


@login_required
@require_GET
def endpoint_list(request: HttpRequest) -> HttpResponse:
    context = {"endpoints": _visible_list(request), "pending": selectors.any_endpoint_pending()}
    return render(request, "fleet/endpoint_list.html", context)


@login_required
@require_GET
def endpoint_rows(request: HttpRequest) -> HttpResponse:
    """The fleet table's body alone, for the list page to poll while probes run."""
    context = {"endpoints": _visible_list(request), "pending": selectors.any_endpoint_pending()}
    return render(request, "fleet/_endpoint_rows.html", context)


@login_required
@require_http_methods(["GET", "POST"])
def endpoint_create(request: HttpRequest) -> HttpResponse:
    permissions.require_write(request.user, "register endpoints")
    form = EndpointForm(request.POST or None, user=request.user)
    if request.method == "POST" and form.is_valid():
        try:
            permissions.check_team(request.user, form.cleaned_data.get("team"))
            endpoint = services.create_endpoint(**form.cleaned_data, created_by=request.user)
        except ValidationError as exc:
            form.apply_service_errors(exc)
        else:
            _say_normalised(request, form.cleaned_data["base_url"])
            messages.success(request, f"Endpoint {endpoint.name} registered; probing it now.")
            return redirect("fleet:endpoint-detail", pk=endpoint.pk)
    return render(request, "fleet/endpoint_form.html", {"form": form, "endpoint": None})


@login_required
@require_GET
def endpoint_detail(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = permissions.endpoint_for(request.user, pk)
    return render(request, "fleet/endpoint_detail.html", selectors.endpoint_detail(endpoint=endpoint))


@login_required
@require_GET
def endpoint_status(request: HttpRequest, pk: int) -> HttpResponse:
    """What the detail page polls: the status panel as HTML, or `?format=json` for scripts."""
    endpoint = permissions.endpoint_for(request.user, pk)
    context = selectors.endpoint_detail(endpoint=endpoint)
    if request.GET.get("format") == "json":
        latest = context["latest_probe"]
        return JsonResponse(
            {
                "id": endpoint.pk,
                "name": endpoint.name,
                "status": endpoint.status,
                "status_reason": endpoint.status_reason,
                "served_model": endpoint.served_model,
                "last_probed_at": endpoint.last_probed_at.isoformat() if endpoint.last_probed_at else None,
                "capabilities": endpoint.capabilities,
                "pending": context["pending"],
                "latest_probe": None
                if latest is None
                else {
                    "id": latest.pk,
                    "status": latest.status,
                    "outcome": latest.outcome,
                    "reason": latest.reason,
                    "duration_ms": latest.duration_ms,
                },
            }
        )
    return render(request, "fleet/_endpoint_status.html", context)


@login_required
@require_http_methods(["GET", "POST"])
def endpoint_edit(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = permissions.endpoint_for(request.user, pk, operate=True)
    initial = {f: getattr(endpoint, f) for f in ("name", "base_url", "kind", "node_class")}
    form = EndpointForm(request.POST or None, initial=initial, endpoint=endpoint, user=request.user)
    if request.method == "POST" and form.is_valid():
        data = dict(form.cleaned_data)
        data["api_key"] = data.get("api_key") or None  # blank keeps the stored key (unless the URL changes)
        try:
            if "team" in data and data["team"] != endpoint.team:
                permissions.check_team(request.user, data["team"], current=endpoint)
            services.update_endpoint(endpoint=endpoint, **data)
        except ValidationError as exc:
            endpoint.refresh_from_db()
            form.apply_service_errors(exc)
        else:
            _say_normalised(request, data["base_url"])
            messages.success(request, f"Endpoint {endpoint.name} saved.")
            return redirect("fleet:endpoint-detail", pk=endpoint.pk)
    return render(request, "fleet/endpoint_form.html", {"form": form, "endpoint": endpoint})


@login_required
@require_http_methods(["GET", "POST"])
def endpoint_delete(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = permissions.endpoint_for(request.user, pk, operate=True)
    if request.method == "POST":
        name = endpoint.name
        services.delete_endpoint(endpoint=endpoint)
        messages.success(request, f"Endpoint {name} deleted.")
        return redirect("fleet:endpoint-list")
    return render(request, "fleet/endpoint_confirm_delete.html", {"endpoint": endpoint})


@login_required
@require_POST
def endpoint_probe(request: HttpRequest, pk: int) -> HttpResponse:
    endpoint = permissions.endpoint_for(request.user, pk, operate=True)
    services.reprobe_endpoint(endpoint=endpoint)
    messages.info(request, f"Re-probing {endpoint.name}.")
    return redirect("fleet:endpoint-detail", pk=endpoint.pk)
