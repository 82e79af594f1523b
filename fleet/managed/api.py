"""REST: register a managed endpoint, and read its servers, events and switches.

POST /api/v1/managed-endpoints/                {name, model_dir, served_name, kind, node_class, team, server_args}
GET  /api/v1/endpoints/{id}/managed/            the managed state (404 for an endpoint registered by URL)
Writes go through fleet.managed.services; a policy change goes through the policy API as for any endpoint.
"""

from __future__ import annotations

from django.contrib.auth.models import Group
from django.http import Http404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ace.api import RejectUnknownFieldsMixin
from fleet import permissions
from fleet.api.serializers import EndpointSerializer
from fleet.api.views import call_service
from fleet.managed import selectors, services
from fleet.managed.models import ManagedKind


class ManagedEndpointInputSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
    name = serializers.CharField(max_length=64)
    model_dir = serializers.CharField(
        max_length=1000, help_text="The model directory on the node (under the model roots)."
    )
    served_name = serializers.CharField(
        max_length=255, required=False, allow_blank=True, help_text="The model id clients send; defaults to the name."
    )
    kind = serializers.ChoiceField(choices=ManagedKind.choices, default=ManagedKind.VLLM)
    node_class = serializers.CharField(max_length=64, required=False)
    server_args = serializers.JSONField(
        required=False,
        default=dict,
        help_text="dtype, max_model_len, tensor_parallel_size, gpu_memory_utilization, enforce_eager; nothing else.",
    )
    team = serializers.SlugRelatedField(
        slug_field="name", queryset=Group.objects.exclude(name__in=permissions.ROLES), required=False, allow_null=True
    )


class ManagedEndpointCreateView(APIView):
    @extend_schema(
        summary="Register a managed endpoint (ACE's worker runs its server)",
        request=ManagedEndpointInputSerializer,
        responses={201: EndpointSerializer},
    )
    def post(self, request: Request) -> Response:
        serializer = ManagedEndpointInputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = dict(serializer.validated_data)
        call_service(permissions.check_team, user=request.user, team=data.get("team"))
        endpoint = call_service(services.create_managed_endpoint, **data, created_by=request.user)
        body = dict(EndpointSerializer(endpoint).data)
        body["managed"] = selectors.managed_state(endpoint.managed)
        return Response(body, status=status.HTTP_201_CREATED)


class ManagedStateView(APIView):
    @extend_schema(
        summary="A managed endpoint's server instances, restarts and switches", responses=OpenApiTypes.OBJECT
    )
    def get(self, request: Request, pk: int) -> Response:
        endpoint = permissions.endpoint_for(request.user, pk)
        managed = selectors.managed_for(endpoint)
        if managed is None:
            raise Http404("This endpoint is registered by URL, not managed.")
        return Response(selectors.managed_state(managed))


class ManagedBaselineView(APIView):
    @extend_schema(
        summary="Re-measure the native multiplier's baseline (the server must run without speculation now)",
        request=None,
        responses={202: OpenApiTypes.OBJECT},
    )
    def post(self, request: Request, pk: int) -> Response:
        endpoint = permissions.endpoint_for(request.user, pk, operate=True)
        managed = selectors.managed_for(endpoint)
        if managed is None:
            raise Http404("This endpoint is registered by URL, not managed.")
        call_service(services.request_baseline, managed=managed)
        return Response(selectors.managed_state(managed), status=status.HTTP_202_ACCEPTED)
