"""REST views: endpoints (CRUD, probe, probes) and probes. Writes go through fleet.services."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response

from ace.query_params import id_param
from fleet import permissions, selectors, services
from fleet.api.serializers import EndpointInputSerializer, EndpointSerializer, ProbeSerializer
from fleet.models import Endpoint, EndpointStatus, ProbeStatus, ServerKind

T = TypeVar("T")


def call_service(fn: Callable[..., T], **kwargs) -> T:
    """Run a service, turning its Django ValidationError into a DRF 400 with per-field messages."""
    try:
        return fn(**kwargs)
    except DjangoValidationError as exc:
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        raise ValidationError(detail) from exc


@extend_schema_view(
    list=extend_schema(
        summary="List endpoints",
        parameters=[
            OpenApiParameter("status", enum=EndpointStatus.values, required=False),
            OpenApiParameter("kind", enum=ServerKind.values, required=False),
        ],
    ),
    retrieve=extend_schema(summary="Get an endpoint"),
    create=extend_schema(
        summary="Register an endpoint (queues its first probe)",
        request=EndpointInputSerializer,
        responses={201: EndpointSerializer},
    ),
    update=extend_schema(
        summary="Replace an endpoint's settings (re-probes when URL, kind or key change)",
        request=EndpointInputSerializer,
        responses={200: EndpointSerializer},
    ),
    partial_update=extend_schema(
        summary="Change some of an endpoint's settings",
        request=EndpointInputSerializer,
        responses={200: EndpointSerializer},
    ),
    destroy=extend_schema(summary="Delete an endpoint with its probe history"),
)
class EndpointViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = EndpointSerializer

    def get_queryset(self):
        # Only what the user may see: another owner's endpoint answers 404, as if it did not exist.
        return permissions.visible_endpoints(
            self.request.user,
            selectors.endpoint_list(
                status=self.request.query_params.get("status"), kind=self.request.query_params.get("kind")
            ),
        )

    def _operable(self) -> Endpoint:
        return permissions.check_endpoint(self.request.user, self.get_object(), operate=True)

    def create(self, request: Request) -> Response:
        data = self._input(request, partial=False)
        data.pop("clear_api_key", None)
        call_service(permissions.check_team, user=request.user, team=data.get("team"))
        notice = services.normalise_base_url(data["base_url"])[1]
        endpoint = call_service(services.create_endpoint, **data, created_by=request.user)
        return Response(_with_notices(endpoint, notice), status=status.HTTP_201_CREATED)

    def update(self, request: Request, pk: str | None = None) -> Response:
        return self._update(request, partial=False)

    def partial_update(self, request: Request, pk: str | None = None) -> Response:
        return self._update(request, partial=True)

    def destroy(self, request: Request, pk: str | None = None) -> Response:
        services.delete_endpoint(endpoint=self._operable())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(summary="Queue a probe of this endpoint now", request=None, responses={202: ProbeSerializer})
    @action(detail=True, methods=["post"])
    def probe(self, request: Request, pk: str | None = None) -> Response:
        probe = services.reprobe_endpoint(endpoint=self._operable())
        return Response(ProbeSerializer(probe).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(summary="This endpoint's probe history, newest first", responses=ProbeSerializer(many=True))
    @action(detail=True, methods=["get"], serializer_class=ProbeSerializer)
    def probes(self, request: Request, pk: str | None = None) -> Response:
        page = self.paginate_queryset(selectors.probe_list(endpoint=self.get_object()))
        return self.get_paginated_response(ProbeSerializer(page, many=True).data)

    def _input(self, request: Request, *, partial: bool) -> dict:
        serializer = EndpointInputSerializer(data=request.data, partial=partial)
        serializer.is_valid(raise_exception=True)
        # With partial=True DRF still fills defaults for absent fields: keep only what was sent.
        data = dict(serializer.validated_data)
        if partial:
            data = {k: v for k, v in data.items() if k in request.data}
        return data

    def _update(self, request: Request, *, partial: bool) -> Response:
        endpoint = self._operable()
        data = self._input(request, partial=partial)
        # A blank or absent key keeps the stored one (unless the URL changes); clear_api_key removes it.
        data["api_key"] = data.get("api_key") or None
        if "team" in data:
            call_service(permissions.check_team, user=request.user, team=data["team"], current=endpoint)
        notice = services.normalise_base_url(data["base_url"])[1] if "base_url" in data else ""
        endpoint = call_service(services.update_endpoint, endpoint=endpoint, **data)
        return Response(_with_notices(endpoint, notice))


def _with_notices(endpoint: Endpoint, *notices: str) -> dict:
    """The endpoint, plus `notices`: what ACE changed in the input on its own (e.g. a /v1 suffix removed)."""
    body = dict(EndpointSerializer(endpoint).data)
    body["notices"] = [n for n in notices if n]
    return body


@extend_schema_view(
    list=extend_schema(
        summary="List probes of all endpoints, newest first",
        parameters=[
            OpenApiParameter("endpoint", int, required=False, description="Only this endpoint's probes"),
            OpenApiParameter("status", enum=ProbeStatus.values, required=False),
        ],
    ),
    retrieve=extend_schema(summary="Get a probe"),
)
class ProbeViewSet(viewsets.ReadOnlyModelViewSet):
    serializer_class = ProbeSerializer

    def get_queryset(self):
        qs = selectors.probe_list(status=self.request.query_params.get("status"))
        qs = qs.filter(endpoint__in=permissions.visible_endpoints(self.request.user))
        endpoint_id = self.request.query_params.get("endpoint")
        if endpoint_id:
            qs = qs.filter(endpoint_id=id_param(endpoint_id, name="endpoint"))
        return qs
