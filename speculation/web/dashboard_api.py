"""REST parity for the dashboard's charts: rollups as time series, fleet summary, shadow projection.

    GET /api/v1/endpoints/{id}/timeseries/?metric=acceptance_rate&range=day[&workload=KEY]
    GET /api/v1/endpoints/{id}/distributions/?range=day[&workload=KEY]  (per-position acceptance, histogram)
    GET /api/v1/endpoints/{id}/projection/?range=day[&c=&v=]
    GET /api/v1/endpoints/{id}/policy-options/              (which modes, drafts, paths fit now, and why not)
    GET /api/v1/fleet-summary/

Same functions as the pages (speculation.selectors.rollups, speculation.engine.projection), so numbers never disagree.
"""

from __future__ import annotations

from dataclasses import asdict

from django.urls import path
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ace.query_params import number_param
from fleet.models import Endpoint
from fleet.permissions import endpoint_for, visible_endpoints
from speculation.models import DraftModel, SpeculationPolicy
from speculation.selectors import costs as cost_selectors
from speculation.selectors import options, rollups
from speculation.selectors.drafts import visible_drafts
from speculation.workloads import keys as workload_keys

app_name = "dashboard-api"

RANGE_PARAM = OpenApiParameter("range", enum=list(rollups.RANGES), required=False, description="default day")
WORKLOAD_PARAM = OpenApiParameter(
    "workload", required=False, description="only this workload's requests (a workload key); default: all"
)


class SeriesSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="mode, action, or speculative/baseline")
    t = serializers.ListField(child=serializers.DateTimeField(), help_text="bucket starts (UTC)")
    y = serializers.ListField(child=serializers.FloatField(allow_null=True))
    n = serializers.ListField(child=serializers.IntegerField(), help_text="records in each bucket")


class ChangePointSerializer(serializers.Serializer):
    at = serializers.DateTimeField()
    by = serializers.CharField()
    changes = serializers.DictField()
    summary = serializers.CharField()


class TimeseriesSerializer(serializers.Serializer):
    endpoint = serializers.IntegerField()
    metric = serializers.ChoiceField(choices=list(rollups.METRICS))
    label = serializers.CharField()
    unit = serializers.CharField()
    range = serializers.ChoiceField(choices=list(rollups.RANGES))
    bucket_seconds = serializers.IntegerField()
    since = serializers.DateTimeField()
    until = serializers.DateTimeField()
    series = SeriesSerializer(many=True)
    change_points = ChangePointSerializer(many=True)


def _workload(request: Request) -> str | None:
    value = request.query_params.get("workload")
    if value is None:
        return None
    try:
        return workload_keys.checked_key(value, param="workload")
    except workload_keys.BadWorkload as exc:
        raise ValidationError({"workload": [exc.message]}) from exc


def _range(request: Request) -> rollups.TimeRange:
    try:
        return rollups.get_range(request.query_params.get("range"))
    except ValueError as exc:
        raise ValidationError({"range": [str(exc)]}) from exc


class TimeseriesView(APIView):
    @extend_schema(
        summary="One rollup metric of an endpoint over time",
        description=(
            "Buckets: 1 min (hour), 10 min (day), 1 h (week). acceptance_rate = accepted/drafted draft tokens "
            "(vLLM's draft acceptance rate, not alpha); alpha = per-position acceptance; mean_accepted_len = "
            "E[N] with the bonus token; multiplier: shadow = projected, prod = measured. Policy changes in the "
            "range come as change_points."
        ),
        parameters=[
            OpenApiParameter("metric", enum=list(rollups.METRICS), required=True),
            RANGE_PARAM,
            WORKLOAD_PARAM,
        ],
        responses={200: TimeseriesSerializer},
    )
    def get(self, request: Request, pk: int) -> Response:
        endpoint = endpoint_for(request.user, pk)
        metric = request.query_params.get("metric", "")
        if metric not in rollups.METRICS:
            raise ValidationError({"metric": [f"choose one of {', '.join(rollups.METRICS)}"]})
        data = rollups.timeseries(
            endpoint_id=endpoint.pk, metric=metric, range_name=_range(request).name, workload=_workload(request)
        )
        return Response(data)


class DistributionsView(APIView):
    @extend_schema(
        summary="Per-position acceptance and accepted-length histogram, per mode",
        parameters=[RANGE_PARAM, WORKLOAD_PARAM],
        responses={
            200: inline_serializer(
                "Distributions",
                {
                    "range": serializers.CharField(),
                    "per_position": serializers.DictField(child=serializers.ListField(allow_null=True)),
                    "histogram": serializers.DictField(child=serializers.ListField()),
                },
            )
        },
    )
    def get(self, request: Request, pk: int) -> Response:
        endpoint = endpoint_for(request.user, pk)
        time_range = _range(request)
        workload = _workload(request)
        now = timezone.now()
        window = {"endpoint_id": endpoint.pk, "since": time_range.since(now), "until": now, "workload": workload}
        return Response(
            {
                "range": time_range.name,
                "per_position": rollups.per_position_acceptance(**window),
                "histogram": rollups.accepted_length_histogram(**window),
            }
        )


class ProjectionView(APIView):
    @extend_schema(
        summary="What prod would give: measured shadow acceptance and costs, multiplier for K = 1..8",
        description="S = E[N] / (v(K) + K c), E[N] = (1 - alpha^(K+1)) / (1 - alpha); c and v(K) as the GPU "
        "worker last measured them (costs.measured_at, costs.v_per_k). c and v override the measured costs "
        "(the response says so with assumed=true, as before any calibration, when v = 1 is used).",
        parameters=[
            RANGE_PARAM,
            OpenApiParameter("c", OpenApiTypes.FLOAT, required=False),
            OpenApiParameter("v", OpenApiTypes.FLOAT, required=False),
        ],
        responses={200: OpenApiTypes.OBJECT},
    )
    def get(self, request: Request, pk: int) -> Response:
        endpoint = endpoint_for(request.user, pk, queryset=Endpoint.objects.select_related("policy__draft"))
        time_range = _range(request)
        measured = rollups.measured_acceptance(endpoint_id=endpoint.pk, since=time_range.since(timezone.now()))
        overrides = {}
        for name in ("c", "v"):
            if name in request.query_params:
                overrides[name] = number_param(request.query_params[name], name=name)
                if overrides[name] < 0 or (name == "v" and overrides[name] == 0):
                    raise ValidationError({name: ["must be positive"]})
        what_if = cost_selectors.projection(endpoint=endpoint, alpha=measured["alpha"], **overrides)
        curve = [
            {
                "k": p.k,
                "expected_tokens": round(p.expected_tokens, 4),
                "multiplier": round(p.multiplier, 4),
                "best": p.best,
            }
            for p in what_if["curve"]
        ]
        return Response({"range": time_range.name, "measured": measured, **what_if, "curve": curve})


class OptionSerializer(serializers.Serializer):
    value = serializers.CharField()
    label = serializers.CharField()
    available = serializers.BooleanField()
    reason = serializers.CharField(help_text="why the option cannot be chosen now (empty when it can)")
    current = serializers.BooleanField()


class PolicyOptionsView(APIView):
    @extend_schema(
        summary="Which modes, drafts and verification paths the endpoint can take now, each with why not",
        responses={
            200: inline_serializer(
                "PolicyOptions",
                {
                    "modes": OptionSerializer(many=True),
                    "drafts": OptionSerializer(many=True),
                    "paths": OptionSerializer(many=True),
                    "effective_path": serializers.CharField(),
                },
            )
        },
    )
    def get(self, request: Request, pk: int) -> Response:
        endpoint = endpoint_for(request.user, pk, queryset=Endpoint.objects.select_related("policy__draft"))
        try:
            policy = endpoint.policy
        except SpeculationPolicy.DoesNotExist:
            policy = SpeculationPolicy(endpoint=endpoint)
        current = DraftModel.objects.filter(pk=policy.draft_id)
        drafts = list((visible_drafts(request.user) | current).order_by("name"))
        return Response(
            {
                "modes": [asdict(o) for o in options.mode_options(policy=policy, endpoint=endpoint)],
                "drafts": [asdict(o) for o in options.draft_options(policy=policy, endpoint=endpoint, drafts=drafts)],
                "paths": [asdict(o) for o in options.path_options(policy=policy, endpoint=endpoint)],
                "effective_path": options.effective_path(policy=policy, endpoint=endpoint),
            }
        )


class FleetSummaryView(APIView):
    @extend_schema(
        summary="Per endpoint, last hour and last day: requests per action, acceptance, multipliers, tok/s",
        responses={200: OpenApiTypes.OBJECT},
    )
    def get(self, request: Request) -> Response:
        visible = list(visible_endpoints(request.user).values_list("pk", flat=True))
        summary = rollups.fleet_summary(endpoint_ids=visible)
        names = dict(Endpoint.objects.filter(pk__in=summary).values_list("pk", "name"))
        return Response([{"endpoint": pk, "name": names.get(pk, ""), **windows} for pk, windows in summary.items()])


urlpatterns = [
    path("endpoints/<int:pk>/timeseries/", TimeseriesView.as_view(), name="endpoint-timeseries"),
    path("endpoints/<int:pk>/distributions/", DistributionsView.as_view(), name="endpoint-distributions"),
    path("endpoints/<int:pk>/projection/", ProjectionView.as_view(), name="endpoint-projection"),
    path("endpoints/<int:pk>/policy-options/", PolicyOptionsView.as_view(), name="endpoint-policy-options"),
    path("fleet-summary/", FleetSummaryView.as_view(), name="fleet-summary"),
]
