"""No request is lost in a blue/green switch: 32 streams run through ACE's gateway (uvicorn) without pause, and one
long stream per switch outlasts it on the old instance, while the supervisor switches a managed endpoint off -> prod
(n-gram) -> prod (draft model) -> off; every stream ends with [DONE] and no error event.

The instances are fake vLLM servers (tests.support.fake_vllm) with the behaviours that made a switch lose a stream:
the gauges count a request only from its first engine step, and a busy server answers /metrics slowly (here 3 s). In
prod on the native path the gateway reads the old instance's /metrics before it sends, so requests that looked the
route up just before it moved reached the old instance seconds later; the drain read the old instance as idle (a
read that timed out counted as 0, a request not yet in the gauges too) and stopped it under their streams.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from django.utils import timezone
from rest_framework.authtoken.models import Token

from fleet.adapters import ProbeReport
from fleet.managed import args as server_args
from fleet.managed.models import InstanceRole, InstanceState, ManagedServer, ServerInstance, Switch, SwitchStatus
from fleet.managed.services import create_managed_endpoint
from fleet.managed.supervisor import Supervisor
from speculation.models import DraftModel
from speculation.services.policies import update_policy

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

NODE_CLASS = "fakeswitch"
STREAMS = 32
FINGERPRINT = "f" * 64
# per token, first engine step, /metrics answer (tests.support.fake_vllm): a stream lasts about 2.7 s
DELAYS = ("0.15", "0.3", "3.0")
SHORT_TOKENS, LONG_TOKENS = 16, 80
STREAM_S = 5.7  # a short stream in prod on the native path: the /metrics read, then the stream


def _fake_argv(*, port: int, **_) -> list[str]:
    return [sys.executable, "-m", "tests.support.fake_vllm", str(port), *DELAYS]


def _fake_probe(self, managed, instance):
    capabilities = {
        "served_model": managed.served_name,
        "tokenizer_fingerprint": FINGERPRINT,
        "native_speculation": bool(instance.speculation),
        "max_context": 1024,
    }
    return ProbeReport(capabilities=capabilities), 1.0, timezone.now()


class Streams:
    """STREAMS clients streaming completions in a loop, and one long stream per switch; what failed, and how many
    requests ended well."""

    def __init__(self, url: str, token: str, model: str) -> None:
        self.url, self.headers, self.model = url + "/v1/completions", {"Authorization": f"Bearer {token}"}, model
        self.stop = threading.Event()
        self.completed = [0] * STREAMS
        self.failures: list[str] = []
        self.phase = "before the switches"  # named in each failure
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(STREAMS)]
        for thread in self.threads:
            thread.start()

    def _request(self, client: httpx.Client, max_tokens: int, started: threading.Event | None = None) -> bool:
        body = {"model": self.model, "prompt": "def f(x):", "max_tokens": max_tokens, "temperature": 0, "stream": True}
        phase = self.phase
        try:
            with client.stream("POST", self.url, json=body, headers=self.headers) as response:
                lines = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        lines.append(line)
                        if started is not None:
                            started.set()
            if response.status_code != 200:
                self.failures.append(f"{phase}: HTTP {response.status_code}: {lines[:1]}")
            elif not lines or lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
                self.failures.append(f"{phase}: a stream of {max_tokens} ended without [DONE]: {lines[-1:]}")
            else:
                return True
        except httpx.HTTPError as exc:
            self.failures.append(f"{phase}: {type(exc).__name__}: {exc}")
        return False

    def _loop(self, index: int) -> None:
        # Spread over a stream's length (not in lockstep): some request always looks its route up just before a move.
        jitter = random.Random(index)
        self.stop.wait(index * STREAM_S / STREAMS)
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                self.stop.wait(jitter.uniform(0, 0.3))
                if self._request(client, SHORT_TOKENS):
                    self.completed[index] += 1

    def long_one(self) -> threading.Thread:
        """A stream that outlasts the switch on the old instance; returns once its first event has come."""
        started = threading.Event()

        def run() -> None:
            with httpx.Client(timeout=120) as client:
                self._request(client, LONG_TOKENS, started)
            started.set()

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        started.wait(60)
        return thread

    def each_completes_one_more(self) -> None:
        before = list(self.completed)
        _wait(
            "every stream to complete a request",
            lambda: all(a > b for a, b in zip(self.completed, before, strict=True)),
            120,
        )

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)


def _wait(what: str, check, timeout_s: float = 120):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _active(endpoint) -> ServerInstance | None:
    return ServerInstance.objects.filter(
        managed__endpoint=endpoint, role=InstanceRole.ACTIVE, state=InstanceState.READY
    ).first()


@pytest.fixture
def supervisor(monkeypatch, tmp_path: Path):
    """The node class's supervisor loop, in a thread, starting fake vLLM instances."""
    monkeypatch.setattr(server_args, "build_argv", _fake_argv)
    monkeypatch.setattr(Supervisor, "_probe", _fake_probe)
    supervisor = Supervisor(node_class=NODE_CLASS, log_dir=tmp_path / "logs")
    thread = threading.Thread(target=supervisor.run, daemon=True)
    thread.start()
    yield supervisor
    supervisor.stop_event.set()
    thread.join(timeout=60)


def test_no_stream_is_lost_in_three_switches_under_32_streams(
    redis_server, managed_ace_server, supervisor, user, tmp_path, settings
):
    settings.MANAGED_SWITCH_CANARY = False
    directory = tmp_path / "target"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    endpoint = create_managed_endpoint(
        name="switching",
        model_dir=str(directory),
        served_name="switching-model",
        node_class=NODE_CLASS,
        created_by=user,
    )
    # a kept baseline: the supervisor measures none (this test is about the switches)
    ManagedServer.objects.filter(endpoint=endpoint).update(baseline={"buckets": {"1": 10.0}})
    draft = DraftModel.objects.create(
        name="fake-draft", kind="draft_model", path=str(tmp_path / "draft"), tokenizer_fingerprint=FINGERPRINT
    )
    _wait("the first instance to serve", lambda: _active(endpoint))
    streams = Streams(managed_ace_server.url, Token.objects.create(user=user).key, endpoint.name)
    try:
        streams.each_completes_one_more()
        switches = (
            ("prod (n-gram)", {"mode": "prod", "mechanism": "ngram", "k": 3}),
            ("prod (draft model)", {"mechanism": "draft_model", "draft": draft, "k": 3}),
            ("off", {"mode": "off"}),
        )
        for label, fields in switches:
            streams.phase = f"the switch to {label}"
            old = _active(endpoint)
            long_one = streams.long_one()  # on the old instance, for 12 s: the drain must wait for it
            endpoint.refresh_from_db()
            update_policy(endpoint=endpoint, user=user, **fields)
            switch = Switch.objects.filter(managed__endpoint=endpoint).order_by("-pk").first()
            _wait(
                f"the switch to {label} to be applied",
                lambda s=switch: Switch.objects.get(pk=s.pk).status in (SwitchStatus.DONE, SwitchStatus.FAILED),
                60,
            )
            assert Switch.objects.get(pk=switch.pk).status == SwitchStatus.DONE, Switch.objects.get(pk=switch.pk).reason
            _wait(
                "the old instance to drain and stop",
                lambda o=old: ServerInstance.objects.filter(pk=o.pk, state=InstanceState.STOPPED).exists(),
                120,
            )
            streams.each_completes_one_more()  # on the new instance
            long_one.join(timeout=60)
    finally:
        streams.close()

    assert streams.failures == [], f"{len(streams.failures)} lost of {sum(streams.completed)}: {streams.failures[:3]}"
    assert sum(streams.completed) >= 4 * STREAMS
    stopped = ServerInstance.objects.filter(managed__endpoint=endpoint, state=InstanceState.STOPPED)
    assert stopped.count() == 3 and all(i.reason == "drained" for i in stopped)
