"""REST: training runs under /api/v1/training-runs/ (list, progress of one, queue a new one): EAGLE heads, and draft
models distilled on an endpoint's captured traffic (kind draft_model)."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from ace.api import RejectUnknownFieldsMixin
from fleet.api.serializers import team_field
from fleet.permissions import check_team
from speculation.models import TrainingKind, TrainingRun
from speculation.selectors.drafts import visible_runs
from speculation.services.draft_distillation import start_distillation_run
from speculation.services.eagle_training import start_training_run


class TrainingRunSerializer(RejectUnknownFieldsMixin, serializers.ModelSerializer):
    """A run; POST with a field it does not know answers 400 naming it (a misspelt setting is never dropped)."""

    draft = serializers.SlugRelatedField(slug_field="name", read_only=True)
    progress = serializers.FloatField(read_only=True)
    owner = serializers.CharField(source="owner.username", read_only=True, default=None)
    team = team_field("A team (Django group) whose members may see the run and its head too; null for none.")
    init_from = serializers.CharField(
        write_only=True, required=False, allow_blank=True, max_length=1000,
        help_text="A registered EAGLE head's name or a head directory under the model roots to continue training "
        "from (warm start: same target and kind of head); for kind draft_model, the draft model to distil (a "
        "registered draft model's name or its directory). The run's config records its directory.",
    )  # fmt: skip

    class Meta:
        model = TrainingRun
        fields = [
            "id", "kind", "name", "target_dir", "target_name", "out_dir", "prompts", "node_class", "seed", "epochs",
            "status", "stage", "epoch", "progress", "loss", "alpha", "mean_accepted_len", "log", "error", "draft",
            "config", "owner", "team", "init_from", "created_at", "started_at", "finished_at", "updated_at",
        ]  # fmt: skip
        read_only_fields = [
            "status", "stage", "epoch", "loss", "alpha", "mean_accepted_len", "log", "error", "draft", "config",
            "created_at", "started_at", "finished_at", "updated_at",
        ]  # fmt: skip
        extra_kwargs = {"name": {"required": False}, "target_name": {"required": False},
                        "target_dir": {"required": False}}  # fmt: skip


class TrainingRunViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.CreateModelMixin, viewsets.GenericViewSet
):
    """Training runs, newest first. Poll one for its progress (epoch, loss, held-out alpha, per-epoch log).

    POST queues a run on the node class's GPU worker: target_dir and out_dir are paths on that node. With kind
    draft_model it distils the draft model named by init_from on `captured:<endpoint>[:<workload>]` (no target_dir).
    """

    serializer_class = TrainingRunSerializer

    def get_queryset(self):
        # Only the runs the user may see: another team's run (and its error text) answers 404.
        return visible_runs(self.request.user)

    def create(self, request: Request, *args, **kwargs) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            check_team(request.user, data.get("team"))
            if data.get("kind") == TrainingKind.DRAFT_MODEL:
                return self._distil(request, data)
            if not data.get("target_dir"):
                raise ValidationError({"target_dir": ["This field is required."]})
            run = start_training_run(
                target_dir=data["target_dir"],
                out_dir=data["out_dir"],
                name=data.get("name", ""),
                target_name=data.get("target_name", ""),
                prompts=data.get("prompts") or "spec_bench",
                epochs=data.get("epochs", 4),
                seed=data.get("seed", 0),
                node_class=data.get("node_class", "cpu"),
                owner=request.user,
                team=data.get("team"),
                init_from=data.get("init_from", ""),
            )
        except DjangoValidationError as exc:
            raise ValidationError(exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}) from exc
        return Response(self.get_serializer(run).data, status=status.HTTP_201_CREATED)

    def _distil(self, request: Request, data: dict) -> Response:
        if data.get("target_dir") or data.get("target_name"):
            raise ValidationError(
                {"target_dir": ["a draft distillation run reads no target: name the draft in init_from"]}
            )
        run = start_distillation_run(
            draft=data.get("init_from", ""),
            out_dir=data["out_dir"],
            name=data.get("name", ""),
            prompts=data.get("prompts", ""),
            epochs=data.get("epochs", 4),
            seed=data.get("seed", 0),
            node_class=data.get("node_class", "cpu"),
            owner=request.user,
            team=data.get("team"),
        )
        return Response(self.get_serializer(run).data, status=status.HTTP_201_CREATED)
