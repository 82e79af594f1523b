"""REST API of the speculation stage (under /api/v1/). Views stay thin: the services validate and write."""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ace.query_params import datetime_param, id_param
from fleet.permissions import check_team, endpoint_for, visible_endpoints
from speculation.models import Action, DraftModel, Mode, StageRecord
from speculation.selectors.drafts import visible_drafts
from speculation.services import drafts as draft_service
from speculation.services import policies as policy_service
from speculation.web.api.serializers import (
    DraftSerializer,
    PolicyChangeSerializer,
    PolicySerializer,
    StageRecordSerializer,
)


def _as_drf(exc: DjangoValidationError) -> ValidationError:
    return ValidationError(exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages})


class PolicyView(APIView):
    """GET the endpoint's policy; PUT/PATCH to change it (validated as a whole; every change kept)."""

    serializer_class = PolicySerializer

    def get(self, request: Request, pk: int) -> Response:
        policy = policy_service.get_policy(endpoint=endpoint_for(request.user, pk))
        return Response(PolicySerializer(policy).data)

    def _change(self, request: Request, pk: int, *, partial: bool) -> Response:
        endpoint = endpoint_for(request.user, pk, operate=True)
        policy = policy_service.get_policy(endpoint=endpoint)
        serializer = PolicySerializer(policy, data=request.data, partial=partial, context={"user": request.user})
        serializer.is_valid(raise_exception=True)
        try:
            policy = policy_service.update_policy(endpoint=endpoint, user=request.user, **serializer.validated_data)
        except DjangoValidationError as exc:
            raise _as_drf(exc) from exc
        return Response(PolicySerializer(policy).data)

    def put(self, request: Request, pk: int) -> Response:
        return self._change(request, pk, partial=False)

    def patch(self, request: Request, pk: int) -> Response:
        return self._change(request, pk, partial=True)


class PolicyPathView(APIView):
    """POST: choose auto's verification path again from the latest probe and measurements (recorded)."""

    @extend_schema(request=None, responses=PolicySerializer)
    def post(self, request: Request, pk: int) -> Response:
        endpoint = endpoint_for(request.user, pk, operate=True)
        try:
            policy = policy_service.reevaluate_path(endpoint=endpoint, user=request.user)
        except DjangoValidationError as exc:
            raise _as_drf(exc) from exc
        return Response(PolicySerializer(policy).data)


class PolicyChangesView(APIView):
    """Every change of the endpoint's policy, newest first: who, when, {field: [old, new]}."""

    @extend_schema(responses=PolicyChangeSerializer(many=True))
    def get(self, request: Request, pk: int) -> Response:
        endpoint = endpoint_for(request.user, pk)
        policy = policy_service.get_policy(endpoint=endpoint)
        changes = policy.changes.select_related("changed_by").all()[:500]
        return Response(PolicyChangeSerializer(changes, many=True).data)


class DraftViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Draft registry. Create reads vocab size, parameter count, VRAM and tokenizer fingerprint from `path`."""

    serializer_class = DraftSerializer

    def get_queryset(self):
        # Only what the user may see: another team's draft answers 404 (read or delete), as if it did not exist.
        return visible_drafts(self.request.user)

    def create(self, request: Request, *args, **kwargs) -> Response:
        serializer = self.get_serializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            check_team(request.user, data.get("team"))
            draft = draft_service.register_draft(
                name=data["name"],
                kind=data["kind"],
                path=data.get("path", ""),
                node_class=data.get("node_class", "cpu"),
                target_name=data.get("target_name", ""),
                owner=request.user,
                team=data.get("team"),
            )
        except DjangoValidationError as exc:
            raise _as_drf(exc) from exc
        return Response(self.get_serializer(draft).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: DraftModel) -> None:
        try:
            draft_service.delete_draft(draft=instance, user=self.request.user)
        except DjangoValidationError as exc:
            raise _as_drf(exc) from exc


_FILTERS = [
    OpenApiParameter("endpoint", int, description="endpoint id"),
    OpenApiParameter("action", str, enum=Action.values),
    OpenApiParameter("mode", str, enum=Mode.values),
    OpenApiParameter("request_id", str),
    OpenApiParameter("since", str, description="ISO 8601 datetime, inclusive"),
    OpenApiParameter("until", str, description="ISO 8601 datetime, exclusive"),
]


@extend_schema(parameters=_FILTERS)
class StageRecordViewSet(viewsets.ReadOnlyModelViewSet):
    """Stage records, newest first, filtered by endpoint, action, mode, request id and time."""

    serializer_class = StageRecordSerializer

    def get_queryset(self):
        params = self.request.query_params
        records = StageRecord.objects.select_related("endpoint").filter(
            endpoint__in=visible_endpoints(self.request.user)
        )
        if params.get("endpoint"):
            records = records.filter(endpoint_id=id_param(params["endpoint"], name="endpoint"))
        for name, choices in (("action", Action.values), ("mode", Mode.values)):
            value = params.get(name)
            if value:
                if value not in choices:
                    raise ValidationError({name: [f"must be one of {', '.join(choices)}"]})
                records = records.filter(**{name: value})
        if params.get("request_id"):
            records = records.filter(request_id=params["request_id"])
        for name, lookup in (("since", "created_at__gte"), ("until", "created_at__lt")):
            if params.get(name):
                records = records.filter(**{lookup: datetime_param(params[name], name=name)})
        return records
