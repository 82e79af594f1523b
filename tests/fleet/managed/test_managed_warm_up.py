"""A starting server that lists its models but whose first generations time out (a cold CPU server) is still
warming up: the supervisor probes it again instead of killing it and starting another from cold; a generation
that fails otherwise, or a server still timing out past the start timeout, fails as before."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from fleet.adapters.base import FailureKind, ProbeError, ProbeReport
from fleet.managed.models import InstanceRole, InstanceState, ServerInstance
from fleet.managed.supervisor import START_TIMEOUT_S, Supervisor

pytestmark = pytest.mark.django_db

CAPABILITIES = {"served_model": "m", "tokenizer_fingerprint": "f" * 64, "native_speculation": False}


def _failing(kind: FailureKind) -> ProbeReport:
    error = ProbeError(kind, "http://127.0.0.1:1/v1/completions: no answer within 10 s (ReadTimeout)")
    return ProbeReport(capabilities=CAPABILITIES, errors=[error.as_record("latency")])


@pytest.fixture
def starting(managed_endpoint):
    return ServerInstance.objects.create(
        managed=managed_endpoint.managed, role=InstanceRole.ACTIVE, state=InstanceState.STARTING, port=41001
    )


def _check(monkeypatch, instance: ServerInstance, report: ProbeReport) -> str:
    supervisor = Supervisor(node_class="cpu")
    monkeypatch.setattr(supervisor, "_ready", lambda _instance: True)
    monkeypatch.setattr(supervisor, "_probe", lambda _managed, _instance: (report, 5.0, timezone.now()))
    monkeypatch.setattr(
        supervisor,
        "_kill",
        lambda inst, state, why: ServerInstance.objects.filter(pk=inst.pk).update(state=state, reason=why),
    )
    supervisor._check_starting_active(instance.managed, instance)
    instance.refresh_from_db()
    return instance.state


def test_a_cold_server_whose_first_generation_times_out_is_probed_again_not_killed(monkeypatch, starting):
    assert _check(monkeypatch, starting, _failing(FailureKind.TIMEOUT)) == InstanceState.STARTING
    assert _check(monkeypatch, starting, ProbeReport(capabilities=CAPABILITIES)) == InstanceState.READY


def test_a_generation_that_fails_otherwise_fails_the_instance(monkeypatch, starting):
    assert _check(monkeypatch, starting, _failing(FailureKind.WRONG_SHAPE)) == InstanceState.FAILED
    assert "probe failed" in starting.reason


def test_a_server_still_timing_out_past_the_start_timeout_fails(monkeypatch, starting):
    ServerInstance.objects.filter(pk=starting.pk).update(
        started_at=timezone.now() - timedelta(seconds=START_TIMEOUT_S + 1)
    )
    starting.refresh_from_db()
    assert _check(monkeypatch, starting, _failing(FailureKind.TIMEOUT)) == InstanceState.FAILED
