"""Auto-pairing over REST: the workload x candidate table with its recommendations, and applying one.

    GET  /api/v1/endpoints/{id}/autopairing/          (speculation.selectors.autopairing)
    POST /api/v1/endpoints/{id}/autopairing/apply/    {"workload": KEY (optional: default every workload pooled)}

Applying is a policy write: operators and admins of the endpoint's team, as PUT .../policy/ (fleet.permissions).
"""

from __future__ import annotations

from dataclasses import asdict

from django.core.exceptions import ValidationError as DjangoValidationError
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from fleet.permissions import endpoint_for
from speculation.selectors.autopairing import pairing_table
from speculation.services.autopairing import apply_recommendation
from speculation.web.api.serializers import PolicySerializer
from speculation.workloads import keys as workload_keys


def table_payload(endpoint_id: int) -> dict:
    table = pairing_table(endpoint_id=endpoint_id)

    def entry(value: dict) -> dict:
        recommendation = value["recommendation"]
        return {
            "cells": [asdict(c) for c in value["cells"]],
            "recommendation": asdict(recommendation) if recommendation else None,
        }

    return {
        "workloads": {name: entry(value) for name, value in table["workloads"].items()},
        "overall": entry(table["overall"]),
    }


class AutoPairingView(APIView):
    @extend_schema(
        summary="Per workload x candidate: best K, projected multiplier with a 95 % interval, and the recommendation",
        responses={200: OpenApiTypes.OBJECT},
    )
    def get(self, request: Request, pk: int) -> Response:
        endpoint = endpoint_for(request.user, pk)
        return Response(table_payload(endpoint.pk))


class AutoPairingApplyView(APIView):
    @extend_schema(
        summary="Apply the recommended candidate and K to the endpoint's policy (recorded in its change history)",
        request=inline_serializer("AutoPairingApply", {"workload": serializers.CharField(required=False)}),
        responses={200: OpenApiTypes.OBJECT},
    )
    def post(self, request: Request, pk: int) -> Response:
        endpoint = endpoint_for(request.user, pk, operate=True)
        data = request.data if isinstance(request.data, dict) else {}
        workload = data.get("workload") or None
        if workload is not None:
            try:
                workload = workload_keys.checked_key(workload, param="workload")
            except workload_keys.BadWorkload as exc:
                raise ValidationError({"workload": [exc.message]}) from exc
        try:
            policy, recommendation = apply_recommendation(endpoint=endpoint, user=request.user, workload=workload)
        except DjangoValidationError as exc:
            raise ValidationError(exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}) from exc
        return Response({"applied": asdict(recommendation), "policy": PolicySerializer(policy).data})
