"""Admin: a read-mostly view of the fleet. Registering and editing endpoints goes through the fleet pages and
the REST API, which validate URLs against the allowed networks; the admin never shows API keys."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from fleet import selectors
from fleet.models import Endpoint, Probe


class ProbeInline(admin.TabularInline):
    model = Probe
    extra = 0
    can_delete = False
    fields = ("created_at", "status", "outcome", "reason", "duration_ms")
    readonly_fields = fields
    ordering = ("-created_at",)
    show_change_link = True

    def has_add_permission(self, request: HttpRequest, obj: Endpoint | None = None) -> bool:
        return False


@admin.register(Endpoint)
class EndpointAdmin(admin.ModelAdmin):
    list_display = ("name", "status", "kind", "served_model", "node_class", "last_probed_at")
    list_filter = ("status", "kind", "node_class")
    search_fields = ("name", "base_url", "served_model")
    fields = (
        "name",
        "base_url",
        "kind",
        "node_class",
        "has_api_key",
        "api_key_masked",
        "status",
        "status_reason",
        "served_model",
        "capabilities",
        "last_probed_at",
        "created_at",
        "updated_at",
        "created_by",
    )
    readonly_fields = fields
    inlines = [ProbeInline]

    @admin.display(boolean=True, description="API key set")
    def has_api_key(self, obj: Endpoint) -> bool:
        return obj.has_api_key

    @admin.display(description="API key")
    def api_key_masked(self, obj: Endpoint) -> str:
        return selectors.masked_api_key(endpoint=obj) or "—"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # register through the fleet pages or the API: they check the URL policy


@admin.register(Probe)
class ProbeAdmin(admin.ModelAdmin):
    list_display = ("id", "endpoint", "status", "outcome", "created_at", "duration_ms")
    list_filter = ("status", "outcome")
    search_fields = ("endpoint__name", "reason")
    list_select_related = ("endpoint",)
    readonly_fields = [f.name for f in Probe._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Probe | None = None) -> bool:
        return False
