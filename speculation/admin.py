"""Admin for the speculation models: drafts are editable; policy history and stage records are facts."""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest

from fleet import permissions
from speculation.models import DraftModel, PolicyChange, SpeculationPolicy, StageRecord


class ReadOnlyAdmin(admin.ModelAdmin):
    # The lookup from a row to its endpoint: staff who are not admins see only their endpoints' rows.
    endpoint_lookup = "endpoint"

    def get_queryset(self, request: HttpRequest):
        visible = permissions.visible_endpoints(request.user)
        return super().get_queryset(request).filter(**{f"{self.endpoint_lookup}__in": visible})

    def get_readonly_fields(self, request: HttpRequest, obj=None) -> list[str]:
        return [f.name for f in self.model._meta.fields]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(DraftModel)
class DraftModelAdmin(admin.ModelAdmin):
    list_display = ("name", "kind", "node_class", "tokenizer_fingerprint", "param_count", "vram_bytes", "created_at")
    list_filter = ("kind", "node_class")
    search_fields = ("name", "path", "target_name", "tokenizer_fingerprint")

    def get_queryset(self, request: HttpRequest):
        # Staff who are not admins see only their own and their teams' drafts, as on the pages and the API.
        return permissions.visible_to(request.user, super().get_queryset(request))


class PolicyChangeInline(admin.TabularInline):
    model = PolicyChange
    extra = 0
    can_delete = False
    fields = ("changed_at", "changed_by", "changes")
    readonly_fields = fields
    ordering = ("-changed_at",)

    def has_add_permission(self, request: HttpRequest, obj=None) -> bool:
        return False


@admin.register(SpeculationPolicy)
class SpeculationPolicyAdmin(ReadOnlyAdmin):
    """Read-only: policy changes go through the speculation services, which keep the change history."""

    list_display = ("endpoint", "mode", "mechanism", "draft", "k", "dynamic_k", "path", "updated_at")
    list_filter = ("mode", "mechanism", "path")
    list_select_related = ("endpoint", "draft")
    inlines = [PolicyChangeInline]


@admin.register(PolicyChange)
class PolicyChangeAdmin(ReadOnlyAdmin):
    endpoint_lookup = "policy__endpoint"
    list_display = ("policy", "changed_at", "changed_by")
    list_select_related = ("policy__endpoint", "changed_by")


@admin.register(StageRecord)
class StageRecordAdmin(ReadOnlyAdmin):
    list_display = (
        "request_id",
        "endpoint",
        "created_at",
        "mode",
        "action",
        "k",
        "acceptance_rate",
        "tok_s",
        "multiplier",
    )
    list_filter = ("mode", "action", "endpoint")
    search_fields = ("request_id", "reason")
    date_hierarchy = "created_at"
    list_select_related = ("endpoint",)
    show_full_result_count = False  # counting 100k+ rows on every page view is slow
