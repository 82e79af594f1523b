"""Managed endpoints with the real vLLM (CPU build), supervised by a real Celery GPU worker's supervisor.

One endpoint lives through the whole module, in order: it starts and becomes ready; a switch to prod
(n-gram, K=3) while a client streams through ACE's gateway in a loop (every request completes, the new
instance's probe reports native speculation, the policy history records the switch); a switch to a draft
whose directory does not exist fails, the old instance keeps serving and the policy is unchanged; a SIGKILL of
the server leads to a recorded restart; deleting the endpoint stops its server. At most two vLLM instances
run at once (during a switch).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ace import processes
from fleet.managed.models import (
    EventKind,
    InstanceRole,
    InstanceState,
    ManagedServer,
    ServerInstance,
    Switch,
    SwitchStatus,
)
from fleet.managed.services import create_managed_endpoint
from fleet.models import Endpoint
from speculation.models import DraftModel, PolicyChange, StageRecord
from speculation.services.policies import get_policy, update_policy
from tests.speculation.conftest import database_url

pytestmark = [pytest.mark.vllm, pytest.mark.worker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

logger = logging.getLogger(__name__)

NODE_CLASS = "managedtest"
WAIT_S = 420
PROMPT = "for i in range(10):\n    print(i)\nfor i in range(10):\n"


@pytest.fixture(scope="module")
def managed_worker(django_db_setup, django_db_blocker, redis_server, artifacts_dir: Path) -> Iterator:
    """A real `celery worker` consuming gpu.<NODE_CLASS>: it starts the supervisor of that node class."""
    env = {
        "DATABASE_URL": database_url(),
        "REDIS_URL": redis_server.url,
        "DJANGO_SETTINGS_MODULE": "ace.settings",
        "ACE_CELERY_EAGER": "false",
        "ACE_MANAGED_SUPERVISOR": "true",
        "ACE_MANAGED_START_TIMEOUT": "300",
    }
    proc = processes.start_celery_worker(
        env=env, log_dir=artifacts_dir, queues=f"gpu.{NODE_CLASS}", name="managed-worker"
    )
    try:
        yield proc
    finally:
        proc.stop(grace_s=40)


def _wait(what: str, check, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def _active(endpoint: Endpoint) -> ServerInstance | None:
    return ServerInstance.objects.filter(
        managed__endpoint=endpoint, role=InstanceRole.ACTIVE, state=InstanceState.READY
    ).first()


class StreamingClient(threading.Thread):
    """Streams completions through ACE's gateway in a loop; every request must end with a finish reason."""

    def __init__(self, client, model: str) -> None:
        super().__init__(daemon=True)
        self.client, self.model = client, model
        self.stop = threading.Event()
        self.completed = 0
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                stream = self.client.completions.create(
                    model=self.model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True
                )
                finish = None
                for chunk in stream:
                    finish = chunk.choices[0].finish_reason or finish if chunk.choices else finish
                if finish is None:
                    self.failures.append("stream ended without a finish reason")
                else:
                    self.completed += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                self.failures.append(f"{type(exc).__name__}: {exc}")


def test_managed_endpoint_lifecycle(managed_worker, demo_pair, gateway_client, user, tmp_path):
    # given: a managed endpoint of the demo target
    endpoint = create_managed_endpoint(
        name="managed-demo",
        model_dir=str(demo_pair.target_dir),
        served_name="managed-demo-model",
        node_class=NODE_CLASS,
        server_args={"dtype": "float32", "max_model_len": 1024, "enforce_eager": True},
        created_by=user,
    )
    # then: the supervisor starts it and routes the endpoint to it once probed
    first = _wait("the first instance to serve", lambda: _active(endpoint))
    endpoint.refresh_from_db()
    assert endpoint.status == "ready", endpoint.status_reason
    assert endpoint.base_url == first.base_url
    assert endpoint.capabilities.get("native_speculation") is False
    reply = gateway_client.completions.create(model=endpoint.name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert reply.choices[0].text
    # and: the supervisor measures the plain baseline of the multiplier, per concurrency bucket
    baseline = _wait("the baseline", lambda: ManagedServer.objects.get(endpoint=endpoint).baseline.get("buckets"))
    assert set(baseline) == {"1", "4"} and all(v > 0 for v in baseline.values())

    # when: prod with n-gram K=3 while a client streams
    client = StreamingClient(gateway_client, endpoint.name)
    client.start()
    _wait("a request before the switch", lambda: client.completed >= 2, 120)
    policy = update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="ngram", k=3)
    assert policy.mode == "off"  # applied only once the new instance serves
    switch = Switch.objects.get(managed__endpoint=endpoint)
    _wait(
        "the switch",
        lambda: (
            Switch.objects.filter(pk=switch.pk)
            .exclude(status__in=[SwitchStatus.PENDING, SwitchStatus.STARTING])
            .exists()
        ),
    )
    switch.refresh_from_db()
    assert switch.status == SwitchStatus.DONE, switch.reason
    served_before = client.completed
    _wait("requests after the switch", lambda: client.completed >= served_before + 3, 120)
    _wait(
        "the old instance to drain and stop",
        lambda: ServerInstance.objects.filter(pk=first.pk, state=InstanceState.STOPPED).exists(),
        120,
    )
    client.stop.set()
    client.join(timeout=120)

    # then: no request failed, the route moved to a speculating instance, the history has the switch
    assert client.failures == [], client.failures[:3]
    endpoint.refresh_from_db()
    second = _active(endpoint)
    assert second is not None and second.pk != first.pk and endpoint.base_url == second.base_url
    assert endpoint.capabilities["native_speculation"] is True
    policy = get_policy(endpoint=endpoint)
    assert (policy.mode, policy.mechanism, policy.k, policy.path) == ("prod", "ngram", 3, "native")
    change = PolicyChange.objects.filter(policy=policy).first()
    assert change.changed_by == user and change.changes["switch"]["outcome"] == "done"
    assert change.changes["mode"] == ["off", "prod"] and change.changes["switch"]["duration_s"] > 0
    # and: requests served after the switch are native prod records; one whose token count is known (a stream
    # without usage has none) carries tok/s, the plain baseline of its load bucket and the multiplier
    native = StageRecord.objects.filter(endpoint=endpoint, action="speculated", path="native")
    _wait("native records of the streams", lambda: native.exists(), 60)
    gateway_client.completions.create(model=endpoint.name, prompt=PROMPT, max_tokens=24, temperature=0)
    record = _wait("a native record with a multiplier", lambda: native.filter(multiplier__isnull=False).first(), 60)
    assert record.baseline_tok_s in baseline.values() and record.drafted_tokens is not None
    assert "per-request metrics" in record.reason, record.reason  # vLLM runs with per-request acceptance
    logger.info(
        "managed switch: %d requests streamed, 0 failed, switch %.1f s, native record %.2f tok/s vs baseline "
        "%.2f (x%.2f), acceptance %s",
        client.completed,
        switch.duration_s,
        record.tok_s,
        record.baseline_tok_s,
        record.multiplier,
        record.acceptance_rate,
    )

    # when: a draft whose directory is gone on the node
    bad = DraftModel.objects.create(
        name="vanished",
        kind="draft_model",
        path=str(tmp_path / "vanished-draft"),
        tokenizer_fingerprint=endpoint.capabilities.get("tokenizer_fingerprint", ""),
    )
    update_policy(endpoint=endpoint, user=user, mechanism="draft_model", draft=bad, k=3)
    failed = _wait(
        "the failed switch",
        lambda: Switch.objects.filter(managed__endpoint=endpoint, status=SwitchStatus.FAILED).first(),
    )

    # then: rolled back, the reason and the log tail recorded, the old instance still serving
    assert failed.reason
    policy = get_policy(endpoint=endpoint)
    assert (policy.mechanism, policy.draft_id) == ("ngram", None)
    rolled_back = PolicyChange.objects.filter(policy=policy).first()
    assert rolled_back.changes["switch"]["outcome"] == "rolled back"
    assert _active(endpoint).pk == second.pk
    reply = gateway_client.completions.create(model=endpoint.name, prompt=PROMPT, max_tokens=8, temperature=0)
    assert reply.choices[0].text

    # when: the server is killed
    os.killpg(second.pid, signal.SIGKILL)
    # then: the exit is recorded with its log tail and a new instance serves
    exited = _wait(
        "the exit to be recorded",
        lambda: endpoint.managed.events.filter(kind=EventKind.EXITED, instance_id=second.pk).first(),
        60,
    )
    assert "signal 9" in exited.message and exited.exit_code == -9
    third = _wait("the restarted instance", lambda: _active(endpoint))
    assert third.pk != second.pk and third.speculation == second.speculation
    assert endpoint.managed.events.filter(kind=EventKind.RESTARTING).exists()

    # when: the endpoint is deleted, its server stops
    pid = third.pid
    Endpoint.objects.filter(pk=endpoint.pk).delete()
    _wait("the server to stop", lambda: not _pid_alive(pid), 60)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): read its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
