"""REST shapes of the speculation stage: policies (with history), drafts, stage records."""

from __future__ import annotations

from rest_framework import serializers

from ace.api import RejectUnknownFieldsMixin
from fleet.api.serializers import team_field
from speculation.models import REGISTRABLE_KINDS, DraftModel, PolicyChange, SpeculationPolicy, StageRecord


class PolicySerializer(RejectUnknownFieldsMixin, serializers.ModelSerializer):
    """A policy; PUT/PATCH with a field it does not know answers 400 naming it (a typo is never ignored)."""

    endpoint = serializers.IntegerField(source="endpoint_id", read_only=True)
    endpoint_name = serializers.CharField(source="endpoint.name", read_only=True)
    draft = serializers.SlugRelatedField(
        slug_field="name", queryset=DraftModel.objects.all(), allow_null=True, required=False
    )
    resolved_path = serializers.SerializerMethodField(
        help_text="The verification path prod uses now (auto: fixed when the policy was saved or re-evaluated)."
    )
    path_evidence = serializers.JSONField(
        read_only=True, help_text="Every path's measured / projected multiplier when auto was last resolved."
    )
    path_warning = serializers.SerializerMethodField(
        help_text="What the latest probe or measurements would change (re-evaluate to apply); empty if nothing."
    )
    updated_by = serializers.CharField(source="updated_by.username", read_only=True, default=None)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        user = self.context.get("user")
        if user is not None:  # a draft the user cannot see reads as one that does not exist (its current one stays)
            from speculation.selectors.drafts import visible_drafts

            current = DraftModel.objects.filter(pk=getattr(self.instance, "draft_id", None))
            self.fields["draft"].queryset = visible_drafts(user) | current

    class Meta:
        model = SpeculationPolicy
        fields = [
            "endpoint",
            "endpoint_name",
            "mode",
            "mechanism",
            "draft",
            "k",
            "dynamic_k",
            "eagle_tree",
            "auto_pairing",
            "shadow_sample_rate",
            "path",
            "target_path",
            "resolved_path",
            "path_evidence",
            "path_resolved_at",
            "path_warning",
            "updated_at",
            "updated_by",
        ]
        read_only_fields = ["updated_at", "path_resolved_at"]

    def get_resolved_path(self, policy: SpeculationPolicy) -> str:
        from speculation.services.policies import resolve_path

        return resolve_path(policy=policy, endpoint=policy.endpoint)

    def get_path_warning(self, policy: SpeculationPolicy) -> str:
        from speculation.services.policies import path_warning

        return path_warning(policy=policy, endpoint=policy.endpoint)


class PolicyChangeSerializer(serializers.ModelSerializer):
    changed_by = serializers.CharField(source="changed_by.username", read_only=True, default=None)

    class Meta:
        model = PolicyChange
        fields = ["id", "changed_at", "changed_by", "changes"]


class DraftSerializer(RejectUnknownFieldsMixin, serializers.ModelSerializer):
    kind = serializers.ChoiceField(choices=REGISTRABLE_KINDS)
    owner = serializers.CharField(source="owner.username", read_only=True, default=None)
    team = team_field("A team (Django group) whose members may see and use the draft too; null for none.")
    implementation = serializers.CharField(
        read_only=True,
        help_text='A draft model: "native" (ACE\'s own model layer) or "generic" (transformers\' model: exact, slower, '
        "batch one); null for other kinds.",
    )

    class Meta:
        model = DraftModel
        fields = [
            "id",
            "name",
            "kind",
            "path",
            "node_class",
            "target_name",
            "tokenizer_fingerprint",
            "vocab_size",
            "param_count",
            "vram_bytes",
            "config",
            "implementation",
            "owner",
            "team",
            "created_at",
        ]
        read_only_fields = ["tokenizer_fingerprint", "vocab_size", "param_count", "vram_bytes", "config", "created_at"]
        # Uniqueness is checked by the service (one message, no race).
        extra_kwargs = {"name": {"validators": []}}


class StageRecordSerializer(serializers.ModelSerializer):
    endpoint_name = serializers.CharField(source="endpoint.name", read_only=True)

    class Meta:
        model = StageRecord
        fields = [
            "id",
            "endpoint",
            "endpoint_name",
            "request_id",
            "created_at",
            "mode",
            "action",
            "reason",
            "path",
            "mechanism",
            "k",
            "drafted_tokens",
            "accepted_tokens",
            "target_passes",
            "per_position_acceptance",
            "accepted_length_hist",
            "acceptance_rate",
            "alpha",
            "mean_accepted_len",
            "output_tokens",
            "tok_s",
            "baseline_tok_s",
            "multiplier",
            "server_step_ms",
            "latency_ms",
        ]
