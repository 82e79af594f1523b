"""The workload key is a filter on the endpoint page's charts and records and on the REST time series."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse
from django.utils import timezone

from fleet.models import Endpoint, EndpointStatus
from fleet.permissions import ADMIN, grant_role
from speculation.models import Action, Mode, SpeculationPolicy, StageRecord

pytestmark = pytest.mark.django_db


@pytest.fixture
def client_in(client):
    user = get_user_model().objects.create_user("ops", password="pw-for-tests-only")
    grant_role(user=user, role=ADMIN)
    client.force_login(user)
    return client


@pytest.fixture
def endpoint() -> Endpoint:
    endpoint = Endpoint.objects.create(name="llama", base_url="http://127.0.0.1:9/", status=EndpointStatus.READY)
    SpeculationPolicy.objects.create(endpoint=endpoint, mode=Mode.SHADOW)
    # code: 4 requests at multiplier 2.0; chat: 2 requests at 1.1 (one bucket, 5 minutes ago)
    rows = [("code", 2.0)] * 4 + [("chat", 1.1)] * 2
    StageRecord.objects.bulk_create(
        StageRecord(
            endpoint=endpoint,
            request_id=f"r{i}",
            mode=Mode.SHADOW,
            action=Action.WOULD_SPECULATE,
            workload=workload,
            drafted_tokens=10,
            accepted_tokens=5,
            target_passes=4,
            multiplier=multiplier,
        )
        for i, (workload, multiplier) in enumerate(rows)
    )
    StageRecord.objects.update(created_at=timezone.now() - timedelta(minutes=5))
    return endpoint


def test_the_timeseries_api_filters_by_workload_and_refuses_a_bad_key(client_in, endpoint):
    url = reverse("dashboard-api:endpoint-timeseries", args=[endpoint.pk])

    every = client_in.get(url, {"metric": "multiplier", "range": "hour"}).json()
    code = client_in.get(url, {"metric": "multiplier", "range": "hour", "workload": "code"}).json()
    chat = client_in.get(url, {"metric": "multiplier", "range": "hour", "workload": "chat"}).json()
    bad = client_in.get(url, {"metric": "multiplier", "workload": "x\x01y"})

    assert [(s["y"], s["n"]) for s in every["series"]] == [([1.7], [6])]  # (4 * 2.0 + 2 * 1.1) / 6
    assert [(s["y"], s["n"]) for s in code["series"]] == [([2.0], [4])]
    assert [(s["y"], s["n"]) for s in chat["series"]] == [([1.1], [2])]
    assert bad.status_code == 400 and "workload" in bad.json()


def test_the_endpoint_page_lists_the_workloads_and_filters_charts_and_records(client_in, endpoint):
    page = reverse("speculation:endpoint", args=[endpoint.pk])

    every = client_in.get(page, {"range": "hour"})
    chat = client_in.get(page, {"range": "hour", "workload": "chat"})
    every_record = client_in.get(page, {"view": "records", "range": "hour"})
    chat_records = client_in.get(page, {"view": "records", "range": "hour", "workload": "chat"})

    assert every.context["workloads"] == ["code", "chat"]  # most requests first
    assert len(every_record.context["page"].object_list) == 6
    assert {r.workload for r in chat_records.context["page"].object_list} == {"chat"}
    assert len(chat_records.context["page"].object_list) == 2
    (series,) = chat.context["charts"]["multiplier"]["series"]
    assert series["y"] == [1.1]
    assert 'data-workload="chat"' in chat.content.decode()
