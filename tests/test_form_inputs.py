"""Every field of every form page takes the fuzz's input classes (control and invisible characters, Unicode digits
and look-alikes, impossible dates) without a 5xx: each is refused on its field or stored as harmless text.

The test client re-raises an exception a view lets escape, so a 500 fails the test with its traceback.
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.urls import reverse

from ace.fuzz.classes import CONTROL_STRINGS, IMPOSSIBLE_DATES, UNICODE_DIGITS
from fleet import services
from fleet.models import Endpoint

pytestmark = pytest.mark.django_db

VALUES = [*CONTROL_STRINGS, *UNICODE_DIGITS, *IMPOSSIBLE_DATES[:2]]
ENDPOINT = {"name": "ok", "base_url": "http://127.0.0.1:9", "kind": "vllm", "node_class": "cpu", "api_key": ""}
FORMS = {
    "fleet:endpoint-create": ENDPOINT,
    "fleet:endpoint-edit": ENDPOINT,
    "fleet:managed-create": {
        **{"name": "m", "kind": "vllm", "model_dir": "/nonexistent", "served_name": "m", "node_class": "cpu"},
        **{"dtype": "auto", "max_model_len": "", "tensor_parallel_size": "", "gpu_memory_utilization": ""},
    },
    "speculation:endpoint-policy": {
        **{"mode": "off", "mechanism": "ngram", "draft": "", "k": "5", "eagle_tree": "", "path": "auto"},
        **{"shadow_sample_rate": "1", "target_path": ""},
    },
    "speculation:endpoint-mode": {"mode": "off"},
    "speculation:draft-list": {"name": "d", "kind": "draft_model", "path": "/nonexistent", "node_class": "cpu"},
}

OF_AN_ENDPOINT = {"fleet:endpoint-edit", "speculation:endpoint-policy", "speculation:endpoint-mode"}


@pytest.fixture
def signed_in(client):
    client.force_login(get_user_model().objects.create_superuser("forms-admin", password="pw-for-tests-only"))
    return client


@pytest.mark.parametrize("name", FORMS)
def test_it_answers_every_field_of_the_form_holding_each_input_class_without_a_5xx(signed_in, name):
    endpoint = services.create_endpoint(name="target", base_url="http://127.0.0.1:8000")
    url = reverse(name, args=[endpoint.pk] if name in OF_AN_ENDPOINT else [])
    statuses = {}
    for field in FORMS[name]:
        for value in VALUES:
            response = signed_in.post(url, {**FORMS[name], field: value})
            statuses[(field, value)] = response.status_code
    assert all(status < 500 for status in statuses.values()), statuses
    # nothing with a control character in its base URL or name was stored
    assert not any(("\r" in e.base_url or "\n" in e.name) for e in Endpoint.objects.all())


@pytest.mark.parametrize("param", ["action", "mode", "range", "workload", "page", "view"])
def test_it_answers_the_endpoint_page_filters_holding_each_input_class_without_a_5xx(signed_in, param):
    endpoint = services.create_endpoint(name="target", base_url="http://127.0.0.1:8000")
    url = reverse("speculation:endpoint", args=[endpoint.pk])
    assert {signed_in.get(url, {param: value}).status_code for value in VALUES} <= {200, 400}
