"""Managed endpoint pages: the registration form (the state panel is the `managed_panel` template tag)."""

from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.exceptions import ValidationError
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_http_methods

from fleet import permissions
from fleet.managed import services
from fleet.managed.forms import ManagedEndpointForm


@login_required
@require_http_methods(["GET", "POST"])
def managed_create(request: HttpRequest) -> HttpResponse:
    permissions.require_write(request.user, "register endpoints")
    form = ManagedEndpointForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            endpoint = services.create_managed_endpoint(**form.service_kwargs(), created_by=request.user)
        except ValidationError as exc:
            form.apply_service_errors(exc)
        else:
            messages.success(request, f"Managed endpoint {endpoint.name} registered; its worker starts the server.")
            return redirect("fleet:endpoint-detail", pk=endpoint.pk)
    return render(request, "fleet/managed/form.html", {"form": form})
