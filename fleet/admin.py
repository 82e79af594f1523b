"""Admin: a read-mostly view of the fleet. Registering and editing endpoints goes through the fleet pages and
the REST API, which validate URLs against the allowed networks; the admin never shows API keys."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from fleet import permissions, selectors
from fleet.models import Endpoint, GatewayTokenScope, Probe


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
        "owner",
        "team",
    )
    # Only ownership is edited here (by admins); the rest goes through the pages and the API (URL policy).
    readonly_fields = tuple(f for f in fields if f not in ("owner", "team"))
    inlines = [ProbeInline]

    def get_queryset(self, request: HttpRequest):
        return permissions.visible_endpoints(request.user, super().get_queryset(request))

    def get_readonly_fields(self, request: HttpRequest, obj: Endpoint | None = None) -> tuple[str, ...]:
        return self.readonly_fields if permissions.is_admin(request.user) else self.fields

    def has_change_permission(self, request: HttpRequest, obj: Endpoint | None = None) -> bool:
        return super().has_change_permission(request, obj) and permissions.is_admin(request.user)

    def has_delete_permission(self, request: HttpRequest, obj: Endpoint | None = None) -> bool:
        if obj is not None and not permissions.can_operate(request.user, obj):
            return False
        return super().has_delete_permission(request, obj) and permissions.can_write(request.user)

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

    def get_queryset(self, request: HttpRequest):
        return super().get_queryset(request).filter(endpoint__in=permissions.visible_endpoints(request.user))

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Probe | None = None) -> bool:
        return False


@admin.register(GatewayTokenScope)
class GatewayTokenScopeAdmin(admin.ModelAdmin):
    """Which endpoints a token may call through the gateway (no row: every endpoint its user can see)."""

    list_display = ("token", "all_visible")
    filter_horizontal = ("endpoints",)
    raw_id_fields = ("token",)

    def has_module_permission(self, request: HttpRequest) -> bool:
        return permissions.is_admin(request.user)

    def has_view_permission(self, request: HttpRequest, obj: GatewayTokenScope | None = None) -> bool:
        return permissions.is_admin(request.user)
