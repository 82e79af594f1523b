"""REST shapes of endpoints and probes. Input serializers check types only; fleet.services holds the rules."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.models import Group
from rest_framework import serializers

from ace.api import RejectUnknownFieldsMixin
from fleet import selectors
from fleet.models import Endpoint, Probe, ServerKind
from fleet.permissions import ROLES


def team_field(help_text: str) -> serializers.SlugRelatedField:
    """An owned object's team by name: a Django group that is not a role group; null for none."""
    return serializers.SlugRelatedField(
        slug_field="name",
        queryset=Group.objects.exclude(name__in=ROLES),
        required=False,
        allow_null=True,
        help_text=help_text,
    )


class ProbeSerializer(serializers.ModelSerializer):
    endpoint_name = serializers.CharField(source="endpoint.name", read_only=True)

    class Meta:
        model = Probe
        fields = [
            "id",
            "endpoint",
            "endpoint_name",
            "status",
            "outcome",
            "reason",
            "capabilities",
            "errors",
            "created_at",
            "started_at",
            "finished_at",
            "duration_ms",
        ]
        read_only_fields = fields


class EndpointSerializer(serializers.ModelSerializer):
    """What the API returns for an endpoint. The API key itself is never part of it."""

    has_api_key = serializers.BooleanField(read_only=True)
    owner = serializers.CharField(source="owner.username", read_only=True, default=None)
    team = serializers.CharField(source="team.name", read_only=True, default=None)
    api_key_masked = serializers.SerializerMethodField(help_text="A mask showing at most the key's last characters.")

    class Meta:
        model = Endpoint
        fields = [
            "id",
            "name",
            "base_url",
            "kind",
            "node_class",
            "has_api_key",
            "api_key_masked",
            "owner",
            "team",
            "status",
            "status_reason",
            "served_model",
            "capabilities",
            "last_probed_at",
            "created_at",
            "updated_at",
        ]
        read_only_fields = fields

    def get_api_key_masked(self, endpoint: Endpoint) -> str:
        return selectors.masked_api_key(endpoint=endpoint)


class EndpointInputSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
    """Register or change an endpoint. `api_key` is write-only; send "" with PATCH to keep, or clear_api_key.

    Changing `base_url` needs `api_key` again (or `clear_api_key`): a stored key never goes to a new URL.
    """

    name = serializers.CharField(max_length=64)
    base_url = serializers.CharField(max_length=500)
    kind = serializers.ChoiceField(choices=ServerKind.choices, default=ServerKind.VLLM)
    node_class = serializers.CharField(max_length=64, default=settings.DEFAULT_NODE_CLASS)
    api_key = serializers.CharField(
        max_length=4096,
        required=False,
        allow_blank=True,
        write_only=True,
        trim_whitespace=True,
        style={"input_type": "password"},
        help_text="Write-only. Stored encrypted; responses only say whether one is set (has_api_key).",
    )
    clear_api_key = serializers.BooleanField(
        required=False, default=False, write_only=True, help_text="Remove the stored API key (updates only)."
    )
    team = team_field("A team (Django group) whose members may operate the endpoint too; null for none.")
