"""fleet.services: registering, changing and removing endpoints validates everything and saves atomically."""

from __future__ import annotations

import logging

import pytest
from django.core.exceptions import ValidationError

from fleet import services
from fleet.models import Endpoint, Probe, ProbeStatus

pytestmark = pytest.mark.django_db

SECRET = "sk-live-0123456789abcdef"


def _register(**overrides) -> Endpoint:
    kwargs = {"name": "llama", "base_url": "http://127.0.0.1:8000", "kind": "vllm", "node_class": "cpu"}
    kwargs.update(overrides)
    return services.create_endpoint(**kwargs)


def _errors(exc_info: pytest.ExceptionInfo[ValidationError]) -> dict[str, list[str]]:
    return exc_info.value.message_dict


def test_it_registers_an_endpoint_and_queues_its_first_probe():
    endpoint = _register(base_url="http://127.0.0.1:8000/")

    assert endpoint.pk is not None
    assert endpoint.base_url == "http://127.0.0.1:8000"  # normalised, no trailing slash
    probes = list(Probe.objects.filter(endpoint=endpoint))
    assert len(probes) == 1
    assert probes[0].status == ProbeStatus.QUEUED


def test_it_stores_the_api_key_encrypted_and_only_decrypts_it_on_request():
    endpoint = _register(api_key=SECRET)

    stored = Endpoint.objects.get(pk=endpoint.pk)
    assert SECRET not in stored.api_key_encrypted
    assert stored.api_key == SECRET
    assert stored.has_api_key
    assert SECRET not in stored.api_key_masked


@pytest.mark.parametrize(
    ("base_url", "fragment"),
    [
        ("http://169.254.169.254/", "outside the allowed networks"),
        ("http://169.254.169.254/latest/meta-data", "outside the allowed networks"),
        ("http://8.8.8.8:8000", "outside the allowed networks"),
        ("ftp://127.0.0.1/models", "scheme 'ftp' is not allowed"),
        ("127.0.0.1:8000", "is not allowed"),
        ("http://127.0.0.1:99999", "malformed URL"),
        ("http://[::1", "malformed URL"),
        ("http://", "has no host"),
        ("http://user:pw@127.0.0.1:8000", "credentials in the URL"),
        ("", "required"),
    ],
)
def test_it_refuses_a_url_it_may_not_fetch_and_saves_nothing(base_url, fragment):
    with pytest.raises(ValidationError) as exc_info:
        _register(base_url=base_url)

    messages = _errors(exc_info)["base_url"]
    assert any(fragment in m for m in messages), messages
    assert not Endpoint.objects.exists()
    assert not Probe.objects.exists()


def test_it_refuses_a_duplicate_name_and_saves_nothing():
    _register(name="llama")

    with pytest.raises(ValidationError) as exc_info:
        _register(name="llama", base_url="http://127.0.0.2:8000")

    assert "already exists" in _errors(exc_info)["name"][0]
    assert Endpoint.objects.count() == 1
    assert Probe.objects.count() == 1


@pytest.mark.parametrize("name", ["Llama", "has space", "-lead", "a" * 65, "ünï"])
def test_it_refuses_a_name_that_is_not_a_slug(name):
    with pytest.raises(ValidationError) as exc_info:
        _register(name=name)

    assert "name" in _errors(exc_info)
    assert not Endpoint.objects.exists()


def test_it_reports_every_wrong_field_at_once():
    with pytest.raises(ValidationError) as exc_info:
        _register(name="Bad Name", base_url="ftp://x", kind="tgi", node_class="GPU A100", api_key="has space")

    assert set(_errors(exc_info)) == {"name", "base_url", "kind", "node_class", "api_key"}


def test_it_never_logs_the_api_key(caplog):
    caplog.set_level(logging.DEBUG)

    endpoint = _register(api_key=SECRET)
    services.update_endpoint(endpoint=endpoint, api_key=SECRET + "x")

    assert caplog.records, "the services log registrations"
    assert SECRET not in caplog.text


def test_changing_the_url_reprobes_but_changing_the_node_class_does_not():
    endpoint = _register()

    services.update_endpoint(endpoint=endpoint, node_class="a100")
    assert Probe.objects.filter(endpoint=endpoint).count() == 1

    services.update_endpoint(endpoint=endpoint, base_url="http://127.0.0.1:8001")
    assert Probe.objects.filter(endpoint=endpoint).count() == 2

    endpoint.refresh_from_db()
    assert (endpoint.node_class, endpoint.base_url) == ("a100", "http://127.0.0.1:8001")


def test_a_refused_update_leaves_the_endpoint_as_it_was():
    endpoint = _register()
    _register(name="other", base_url="http://127.0.0.1:9000")

    with pytest.raises(ValidationError) as exc_info:
        services.update_endpoint(endpoint=endpoint, name="other", base_url="http://169.254.169.254")

    assert set(_errors(exc_info)) == {"name", "base_url"}
    stored = Endpoint.objects.get(pk=endpoint.pk)
    assert (stored.name, stored.base_url) == ("llama", "http://127.0.0.1:8000")


def test_an_update_keeps_the_stored_key_unless_a_new_one_is_given_or_it_is_cleared():
    endpoint = _register(api_key=SECRET)

    services.update_endpoint(endpoint=endpoint, api_key=None, node_class="a100")
    assert Endpoint.objects.get(pk=endpoint.pk).api_key == SECRET

    services.update_endpoint(endpoint=endpoint, api_key="sk-other-key-000000")
    assert Endpoint.objects.get(pk=endpoint.pk).api_key == "sk-other-key-000000"

    services.update_endpoint(endpoint=endpoint, clear_api_key=True)
    assert not Endpoint.objects.get(pk=endpoint.pk).has_api_key


def test_renaming_to_its_own_name_is_not_a_duplicate():
    endpoint = _register()

    services.update_endpoint(endpoint=endpoint, name="llama")

    assert Endpoint.objects.get(pk=endpoint.pk).name == "llama"


def test_deleting_an_endpoint_removes_its_probe_history():
    endpoint = _register()
    services.reprobe_endpoint(endpoint=endpoint)

    services.delete_endpoint(endpoint=endpoint)

    assert not Endpoint.objects.exists()
    assert not Probe.objects.exists()


def test_reprobe_queues_a_new_probe():
    endpoint = _register()

    probe = services.reprobe_endpoint(endpoint=endpoint)

    assert probe.endpoint_id == endpoint.pk
    assert probe.status == ProbeStatus.QUEUED
    assert Probe.objects.filter(endpoint=endpoint).count() == 2


@pytest.mark.parametrize("api_key", ["sk-abc\n", "sk-abc\r\n", "sk-\u00e4bc"])
def test_it_refuses_an_api_key_ending_in_a_line_break_or_not_ascii(api_key):
    # `$` in a pattern matches before a trailing newline: the key would go out as a header line of its own
    with pytest.raises(ValidationError) as exc_info:
        _register(api_key=api_key)
    assert set(_errors(exc_info)) == {"api_key"}
    assert not Endpoint.objects.exists()
