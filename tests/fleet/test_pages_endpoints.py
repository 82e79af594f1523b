"""Fleet pages: login required, CSRF on, forms show clear errors, failures and capabilities are readable."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from fleet import selectors, services
from fleet.models import Endpoint, EndpointStatus, Probe, ProbeStatus
from fleet.permissions import OPERATOR, grant_role

pytestmark = pytest.mark.django_db

SECRET = "sk-live-0123456789abcdef"


@pytest.fixture
def user():
    # An operator owning the endpoints it works with (roles: tests/fleet/test_roles.py).
    user = get_user_model().objects.create_user(username="ops", password="pw-ops-123456")
    grant_role(user=user, role=OPERATOR)
    return user


@pytest.fixture
def browser(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def ready_endpoint(user) -> Endpoint:
    endpoint = services.create_endpoint(name="llama", base_url="http://127.0.0.1:8000", api_key=SECRET, created_by=user)
    Probe.objects.filter(endpoint=endpoint).update(
        status=ProbeStatus.DONE, outcome=EndpointStatus.READY, duration_ms=812.0, finished_at=timezone.now()
    )
    Endpoint.objects.filter(pk=endpoint.pk).update(
        status=EndpointStatus.READY,
        served_model="ace-demo-target",
        last_probed_at=timezone.now(),
        capabilities={"max_context": 1024, "prompt_scoring": True, "native_speculation": False},
    )
    endpoint.refresh_from_db()
    return endpoint


def _form(**overrides) -> dict:
    data = {"name": "llama", "base_url": "http://127.0.0.1:8000", "kind": "vllm", "node_class": "cpu", "api_key": ""}
    data.update(overrides)
    return data


@pytest.mark.parametrize(
    "name",
    ["fleet:endpoint-list", "fleet:endpoint-create", "fleet:endpoint-rows"],
)
def test_pages_require_login(client, name):
    response = client.get(reverse(name))

    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))


@pytest.mark.parametrize("name", ["endpoint-detail", "endpoint-status", "endpoint-edit", "endpoint-delete"])
def test_endpoint_pages_require_login(client, ready_endpoint, name):
    response = client.get(reverse(f"fleet:{name}", args=[ready_endpoint.pk]))

    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))


def test_the_login_page_logs_in_and_lands_on_the_fleet(client, user):
    page = client.get(reverse("login"))
    response = client.post(reverse("login"), {"username": "ops", "password": "pw-ops-123456"})

    assert page.status_code == 200
    assert response.status_code == 302
    assert response["Location"] == reverse("fleet:endpoint-list")


def test_an_empty_fleet_tells_what_to_do_next(browser):
    html = browser.get(reverse("fleet:endpoint-list")).content.decode()

    assert "No endpoint registered yet" in html
    assert reverse("fleet:endpoint-create") in html


def test_the_fleet_list_shows_status_kind_model_node_class_and_last_probe(browser, ready_endpoint, user):
    Endpoint.objects.create(
        owner=user,
        name="down",
        base_url="http://127.0.0.1:9",
        status=EndpointStatus.UNREACHABLE,
        status_reason="connection refused by 127.0.0.1:9",
    )

    html = browser.get(reverse("fleet:endpoint-list")).content.decode()

    for text in ("llama", "Ready", "vLLM", "ace-demo-target", "cpu", "812 ms", "Unreachable", "connection refused"):
        assert text in html, text
    assert 'data-pending="false"' in html  # nothing in flight: the page does not poll


def test_registering_through_the_form_saves_and_redirects_to_the_detail_page(browser):
    response = browser.post(reverse("fleet:endpoint-create"), _form(api_key=SECRET))

    endpoint = Endpoint.objects.get(name="llama")
    assert response.status_code == 302
    assert response["Location"] == reverse("fleet:endpoint-detail", args=[endpoint.pk])
    assert endpoint.api_key == SECRET
    detail = browser.get(response["Location"]).content.decode()
    assert 'data-pending="true"' in detail  # the probe is queued: the status panel polls
    assert SECRET not in detail


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"base_url": "http://169.254.169.254/"}, "outside the allowed networks"),
        ({"base_url": "ftp://127.0.0.1/"}, "scheme &#x27;ftp&#x27; is not allowed"),
        ({"base_url": "http://127.0.0.1:99999"}, "malformed URL"),
        ({"name": "Bad Name"}, "lowercase letters"),
        ({"base_url": ""}, "This field is required"),
    ],
)
def test_the_form_shows_what_is_wrong_and_saves_nothing(browser, overrides, message):
    response = browser.post(reverse("fleet:endpoint-create"), _form(api_key=SECRET, **overrides))

    html = response.content.decode()
    assert response.status_code == 200
    assert message in html
    assert 'class="error field-error"' in html
    assert SECRET not in html  # the key is not echoed back into the form
    assert not Endpoint.objects.exists()


def test_the_form_refuses_a_duplicate_name(browser, ready_endpoint):
    response = browser.post(reverse("fleet:endpoint-create"), _form(base_url="http://127.0.0.2:8000"))

    assert "already exists" in response.content.decode()
    assert Endpoint.objects.count() == 1


def test_the_detail_page_shows_capabilities_history_and_only_a_masked_key(browser, ready_endpoint):
    Probe.objects.create(
        endpoint=ready_endpoint,
        status=ProbeStatus.DONE,
        outcome=EndpointStatus.UNAUTHORIZED,
        reason="unauthorized: HTTP 401 from /v1/models: check the API key",
        errors=[{"step": "models", "kind": "unauthorized", "message": "bad key", "status_code": 401}],
        duration_ms=35.0,
    )

    html = browser.get(reverse("fleet:endpoint-detail", args=[ready_endpoint.pk])).content.decode()

    for text in ("Max context (tokens)", "1024", "Prompt scoring", "Native speculative decoding", "no"):
        assert text in html, text
    assert "unauthorized: HTTP 401 from /v1/models: check the API key" in html
    assert "unauthorized (HTTP 401) — bad key" in html
    assert "Unauthorized" in html and "35 ms" in html
    assert ready_endpoint.api_key_masked in html
    assert SECRET not in html
    assert reverse("fleet:endpoint-probe", args=[ready_endpoint.pk]) in html


def test_the_edit_form_never_renders_the_key_and_blank_keeps_it(browser, ready_endpoint):
    url = reverse("fleet:endpoint-edit", args=[ready_endpoint.pk])

    page = browser.get(url).content.decode()
    response = browser.post(url, _form(node_class="a100"))

    assert SECRET not in page
    assert response.status_code == 302
    stored = Endpoint.objects.get(pk=ready_endpoint.pk)
    assert (stored.node_class, stored.api_key) == ("a100", SECRET)


def test_the_edit_form_shows_errors_and_changes_nothing(browser, ready_endpoint):
    url = reverse("fleet:endpoint-edit", args=[ready_endpoint.pk])

    response = browser.post(url, _form(base_url="http://169.254.169.254/"))

    assert "outside the allowed networks" in response.content.decode()
    assert Endpoint.objects.get(pk=ready_endpoint.pk).base_url == "http://127.0.0.1:8000"


def test_the_status_view_returns_the_panel_or_json_without_the_key(browser, ready_endpoint):
    url = reverse("fleet:endpoint-status", args=[ready_endpoint.pk])

    fragment = browser.get(url).content.decode()
    data = browser.get(url, {"format": "json"}).json()

    assert fragment.lstrip().startswith('<div id="endpoint-status"')
    assert "ace-demo-target" in fragment
    assert data["status"] == "ready"
    assert data["pending"] is False
    assert data["capabilities"]["max_context"] == 1024
    assert SECRET not in fragment + str(data)


def test_reprobe_needs_a_post_and_queues_a_probe(browser, ready_endpoint):
    url = reverse("fleet:endpoint-probe", args=[ready_endpoint.pk])

    assert browser.get(url).status_code == 405
    response = browser.post(url)

    assert response.status_code == 302
    assert Probe.objects.filter(endpoint=ready_endpoint, status=ProbeStatus.QUEUED).count() == 1


def test_delete_asks_for_confirmation_then_deletes(browser, ready_endpoint):
    url = reverse("fleet:endpoint-delete", args=[ready_endpoint.pk])

    confirm = browser.get(url)
    assert "cannot be undone" in confirm.content.decode()
    assert Endpoint.objects.exists()

    response = browser.post(url)
    assert response["Location"] == reverse("fleet:endpoint-list")
    assert not Endpoint.objects.exists()


def test_posts_without_a_csrf_token_are_refused(user):
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)

    response = client.post(reverse("fleet:endpoint-create"), _form())

    assert response.status_code == 403
    assert not Endpoint.objects.exists()


def test_an_unknown_endpoint_is_a_404(browser):
    assert browser.get(reverse("fleet:endpoint-detail", args=[999])).status_code == 404


def test_the_vendored_plotly_matches_the_installed_package():
    call_command("vendor_static", "--check")


def test_ace_token_prints_a_token_that_authenticates(user, capsys):
    call_command("ace_token", "ops")
    key = capsys.readouterr().out.strip()

    response = Client().get("/api/v1/endpoints/", HTTP_AUTHORIZATION=f"Token {key}")

    assert len(key) == 40
    assert response.status_code == 200


def test_capabilities_read_as_labelled_rows_in_a_fixed_order():
    rows = selectors.capability_rows(
        {"zeta_extra": 1.23456, "native_speculation": False, "models": ["a", "b"], "canary_token_ids": list(range(20))}
    )

    assert [(r.label, r.value) for r in rows] == [
        ("Served models", "a, b"),
        ("Canary token ids", "20 ids: 0, 1, 2, 3, 4, 5, 6, 7 …"),
        ("Native speculative decoding", "no"),
        ("Zeta extra", "1.235"),
    ]


@pytest.mark.parametrize(
    "url",
    [
        "/admin/fleet/endpoint/",
        "/admin/fleet/probe/",
        "/admin/speculation/draftmodel/",
        "/admin/speculation/speculationpolicy/",
        "/admin/speculation/policychange/",
        "/admin/speculation/stagerecord/",
    ],
)
def test_admin_lists_render(url, ready_endpoint, admin_client):
    assert admin_client.get(url).status_code == 200


def test_the_admin_shows_the_endpoint_without_its_key(ready_endpoint, admin_client):
    response = admin_client.get(f"/admin/fleet/endpoint/{ready_endpoint.pk}/change/")

    html = response.content.decode()
    assert response.status_code == 200
    assert ready_endpoint.api_key_masked in html
    assert SECRET not in html
    assert ready_endpoint.api_key_encrypted not in html


def test_a_key_encrypted_with_another_secret_does_not_break_the_pages(browser, ready_endpoint):
    from cryptography.fernet import Fernet

    Endpoint.objects.filter(pk=ready_endpoint.pk).update(
        api_key_encrypted=Fernet(Fernet.generate_key()).encrypt(b"old-key").decode()
    )

    detail = browser.get(reverse("fleet:endpoint-detail", args=[ready_endpoint.pk]))
    api = browser.get(f"/api/v1/endpoints/{ready_endpoint.pk}/")

    assert detail.status_code == 200
    assert "cannot be decrypted" in detail.content.decode()
    assert api.json()["api_key_masked"] == selectors.UNDECRYPTABLE_KEY
