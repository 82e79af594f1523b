"""Captured traffic at rest: encrypted, bounded by its endpoint's size cap and retention, gone with its endpoint;
and the gateway's sample draw."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from cryptography.fernet import Fernet
from django.core.exceptions import ValidationError
from django.test import override_settings
from django.utils import timezone

from fleet.models import Endpoint
from speculation.gateway.capture import chosen, opted_out
from speculation.models import CapturedRequest, CaptureSetting
from speculation.services import captures
from speculation.services.records_retention import prune

PROMPT = [101, 102, 103, 104]
OUTPUT = [201, 202, 70_000]


def _endpoint(name: str = "cap", **setting) -> Endpoint:
    endpoint = Endpoint.objects.create(name=name, base_url="http://127.0.0.1:9", kind="vllm")
    CaptureSetting.objects.create(endpoint=endpoint, enabled=True, sample_rate=1.0, **setting)
    return endpoint


def _write(endpoint: Endpoint, n: int = 1, *, workload: str = "w", output=OUTPUT) -> None:
    row = dict(endpoint_id=endpoint.pk, workload=workload, mode="off", prompt_ids=PROMPT, output_ids=output)
    assert captures.write_captures([row] * n) == n


def test_ids_pack_and_unpack_whole():
    assert captures.unpack(captures.pack(PROMPT, OUTPUT)) == (PROMPT, OUTPUT)
    assert captures.unpack(captures.pack([], [5])) == ([], [5])


@pytest.mark.django_db
def test_stored_bytes_are_not_plaintext():
    # given a capture written
    endpoint = _endpoint()
    _write(endpoint)
    row = CapturedRequest.objects.get(endpoint=endpoint)
    # then neither the packed ids nor any id as text is in the stored column
    plain = captures.pack(PROMPT, OUTPUT)
    assert plain not in row.sealed.encode() and "70000" not in row.sealed and "101" not in row.sealed
    assert row.size_bytes == len(row.sealed) > len(plain)
    # and only ACE's key opens it
    assert captures.open_capture(row) == (PROMPT, OUTPUT)
    with override_settings(ENDPOINT_KEY_ENCRYPTION_KEY=Fernet.generate_key().decode()):
        with pytest.raises(ValueError, match="cannot be decrypted"):
            captures.open_capture(row)


@pytest.mark.django_db
def test_the_size_cap_keeps_the_newest_captures_within_it():
    # given an endpoint whose cap holds three captures
    endpoint = _endpoint()
    _write(endpoint)
    one = CapturedRequest.objects.get().size_bytes
    CaptureSetting.objects.filter(endpoint=endpoint).update(max_bytes=3 * one + one // 2)
    first = CapturedRequest.objects.get().pk
    # when seven more are written
    _write(endpoint, 7)
    # then the store never exceeds the cap, and the oldest went first
    kept = list(CapturedRequest.objects.filter(endpoint=endpoint).values_list("pk", flat=True))
    assert len(kept) == 3 and first not in kept
    assert sum(CapturedRequest.objects.values_list("size_bytes", flat=True)) <= 3 * one + one // 2


@pytest.mark.django_db
def test_a_lower_cap_applies_to_what_is_stored_at_once():
    endpoint = _endpoint()
    _write(endpoint, 4)
    one = CapturedRequest.objects.first().size_bytes
    captures.update_setting(endpoint=endpoint, max_bytes=one)
    assert CapturedRequest.objects.filter(endpoint=endpoint).count() == 1


@pytest.mark.django_db
def test_the_pruning_task_deletes_captures_past_their_endpoints_retention():
    # given captures of two endpoints with different retentions, some 10 days old
    short, long = _endpoint("short", retention_days=7), _endpoint("long", retention_days=30)
    for endpoint in (short, long):
        _write(endpoint, 2)
        old = CapturedRequest.objects.filter(endpoint=endpoint).order_by("id").first()
        CapturedRequest.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=10))
    # when the pruning task runs
    pruned = prune()
    # then only the one past its endpoint's retention is gone
    assert pruned.captures == 1
    assert CapturedRequest.objects.filter(endpoint=short).count() == 1
    assert CapturedRequest.objects.filter(endpoint=long).count() == 2


@pytest.mark.django_db
def test_deleting_an_endpoint_deletes_its_captures():
    endpoint, other = _endpoint("gone"), _endpoint("stays")
    _write(endpoint, 2)
    _write(other)
    endpoint.delete()
    assert list(CapturedRequest.objects.values_list("endpoint_id", flat=True)) == [other.pk]
    assert not CaptureSetting.objects.filter(endpoint_id=endpoint.pk).exists()


@pytest.mark.django_db
def test_deleting_one_workloads_captures_keeps_the_others():
    endpoint = _endpoint()
    _write(endpoint, 2, workload="chat")
    _write(endpoint, 3, workload="code")
    assert captures.delete_captures(endpoint=endpoint, workload="chat") == 2
    assert set(CapturedRequest.objects.values_list("workload", flat=True)) == {"code"}


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "bad"),
    [
        ({"sample_rate": 1.5}, "sample_rate"),
        ({"sample_rate": -0.1}, "sample_rate"),
        ({"retention_days": -1}, "retention_days"),
        ({"retention_days": 0}, "retention_days"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"enabled": "yes"}, "enabled"),
        ({"rate": 0.5}, "rate"),
    ],
)
def test_a_bad_setting_is_refused_naming_it_and_nothing_is_saved(fields, bad):
    endpoint = Endpoint.objects.create(name="bad", base_url="http://127.0.0.1:9", kind="vllm")
    with pytest.raises(ValidationError) as caught:
        captures.update_setting(endpoint=endpoint, **{"enabled": True, **fields})
    assert bad in caught.value.message_dict
    assert not CaptureSetting.objects.filter(endpoint=endpoint).exists()


def test_the_sample_draw_keeps_the_rate():
    # 20,000 seeded draws at rate 0.25: the standard error of the fraction is 0.0031, the tolerance 4 of them (a
    # wrong rate of 0.2 or 0.3 is 16 away); the seed makes the run repeatable
    draw = random.Random(7).random
    kept = sum(chosen(0.25, opt_out=False, draw=draw) for _ in range(20_000)) / 20_000
    assert abs(kept - 0.25) < 4 * 0.0031
    assert not any(chosen(0.0, opt_out=False, draw=draw) for _ in range(1000))
    assert all(chosen(1.0, opt_out=False, draw=draw) for _ in range(1000))
    assert not any(chosen(1.0, opt_out=True, draw=draw) for _ in range(1000))


@pytest.mark.parametrize(("value", "out"), [(None, False), ("", False), ("0", False), ("false", False),
                                            ("1", True), ("true", True), ("please", True)])  # fmt: skip
def test_the_opt_out_header_opts_out_unless_it_says_no(value, out):
    assert opted_out(value) is out
