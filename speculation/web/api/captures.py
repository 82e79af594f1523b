"""Traffic capture over REST, for admins of the endpoint's team only (fleet.permissions.check_captures):

    GET / PUT / PATCH  /api/v1/endpoints/{id}/capture/    the opt-in setting (off by default)
    GET                /api/v1/endpoints/{id}/captures/   captured requests, tokens and bytes per workload
    DELETE             /api/v1/endpoints/{id}/captures/   delete them all, or ?workload=KEY's only

No route returns captured tokens or text: they are read only by a training run (speculation.services.eagle_training).
"""

from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ace.api import RejectUnknownFieldsMixin
from fleet.permissions import check_captures, endpoint_for
from speculation.selectors.captures import summary
from speculation.services import captures as capture_service
from speculation.workloads import keys as workload_keys


class CaptureSettingSerializer(RejectUnknownFieldsMixin, serializers.Serializer):
    endpoint = serializers.IntegerField(source="endpoint_id", read_only=True)
    enabled = serializers.BooleanField(required=False, help_text="Capture this endpoint's traffic (off by default).")
    sample_rate = serializers.FloatField(
        required=False, min_value=0.0, max_value=1.0, help_text="The fraction of requests kept, 0-1."
    )
    retention_days = serializers.IntegerField(
        required=False, min_value=1, max_value=capture_service.MAX_RETENTION_DAYS, help_text="Days a capture is kept."
    )
    max_bytes = serializers.IntegerField(
        required=False,
        min_value=1,
        max_value=capture_service.MAX_CAP_BYTES,
        help_text="The endpoint's captures (encrypted) at most; the oldest go first.",
    )
    updated_at = serializers.DateTimeField(read_only=True)
    updated_by = serializers.CharField(source="updated_by.username", read_only=True, default=None)


def _endpoint(request: Request, pk: int):
    return check_captures(request.user, endpoint_for(request.user, pk))


class CaptureSettingView(APIView):
    serializer_class = CaptureSettingSerializer

    def get(self, request: Request, pk: int) -> Response:
        setting = capture_service.get_setting(endpoint=_endpoint(request, pk))
        return Response(CaptureSettingSerializer(setting).data)

    def _change(self, request: Request, pk: int, *, partial: bool) -> Response:
        endpoint = _endpoint(request, pk)
        setting = capture_service.get_setting(endpoint=endpoint)
        serializer = CaptureSettingSerializer(setting, data=request.data, partial=partial)
        serializer.is_valid(raise_exception=True)
        try:
            setting = capture_service.update_setting(endpoint=endpoint, user=request.user, **serializer.validated_data)
        except DjangoValidationError as exc:
            raise ValidationError(exc.message_dict) from exc
        return Response(CaptureSettingSerializer(setting).data)

    def put(self, request: Request, pk: int) -> Response:
        return self._change(request, pk, partial=False)

    def patch(self, request: Request, pk: int) -> Response:
        return self._change(request, pk, partial=True)


class CapturesView(APIView):
    @extend_schema(
        summary="Captured requests, prompt and output tokens and stored bytes, per workload and in total",
        responses={200: OpenApiTypes.OBJECT},
    )
    def get(self, request: Request, pk: int) -> Response:
        return Response(summary(endpoint_id=_endpoint(request, pk).pk))

    @extend_schema(
        summary="Delete the endpoint's captured requests (all, or one workload's)",
        parameters=[OpenApiParameter("workload", str, description="only this workload's")],
        responses={200: OpenApiTypes.OBJECT},
    )
    def delete(self, request: Request, pk: int) -> Response:
        endpoint = _endpoint(request, pk)
        workload = request.query_params.get("workload")
        if workload is not None:
            try:
                workload = workload_keys.checked_key(workload, param="workload")
            except workload_keys.BadWorkload as exc:
                raise ValidationError({"workload": [exc.message]}) from exc
        return Response({"deleted": capture_service.delete_captures(endpoint=endpoint, workload=workload)})
