"""Managed endpoints with the real vLLM (CPU build), supervised by a real Celery GPU worker's supervisor.

One endpoint lives through the whole module, in order: it starts and becomes ready; 8 concurrent streaming
clients (4 greedy, 4 at temperature 0.7) run through ACE's gateway while the mode changes. First off -> prod
(n-gram, K=3) with the switch canary on (the default): vLLM 0.32's CPU build gives wrong greedy outputs for
greedy requests batched with sampled ones when it speculates (scripts/repro_vllm_mixed_batch.py), the canary
must catch it, refuse the switch and keep the plain instance serving, with the reason in the change history
and on the page. Then, with the canary turned off (ACE_MANAGED_CANARY=false), the mode goes off -> prod
(n-gram) -> prod (demo draft model, K=3) -> off, each a blue/green switch (every request completes with a
finish reason, each prod period leaves native records with acceptance and a multiplier, the policy history
records each switch, greedy outputs of both off periods equal off's; the prod periods' greedy outputs are
vLLM's defect, logged); during the n-gram period a switch to a draft whose directory does not exist fails,
the old instance keeps serving and the policy is unchanged; a SIGKILL of the server mid-stream ends that
stream with a clear error (nothing hangs) and leads to a recorded restart, shown on the endpoint page;
deleting the endpoint stops its server. At most two vLLM instances run at once (during a switch); seven
starts in all.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from django.test import Client
from django.urls import reverse

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
from speculation.services.drafts import register_draft
from speculation.services.policies import get_policy, update_policy
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.worker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

logger = logging.getLogger(__name__)

PROMPT = "for i in range(10):\n    print(i)\nfor i in range(10):\n"
MAX_TOKENS = 16
CLIENTS = 8  # half greedy, half at temperature 0.7
ROUTE_MARGIN_S = 5.0  # a request sent this soon after a switch was done may still reach the old instance


def _active(endpoint: Endpoint) -> ServerInstance | None:
    return ServerInstance.objects.filter(
        managed__endpoint=endpoint, role=InstanceRole.ACTIVE, state=InstanceState.READY
    ).first()


class StreamingClient(threading.Thread):
    """Streams completions through ACE's gateway in a loop; every request must end with a finish reason and,
    when it stopped at max_tokens, carry all of them (usage)."""

    def __init__(self, client, model: str, temperature: float) -> None:
        super().__init__(daemon=True)
        self.client, self.model, self.temperature = client, model, temperature
        self.stop = threading.Event()
        self.completed = 0
        self.texts: list[tuple[float, float, str]] = []  # (when the request was sent, when it ended, the text)
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.stop.is_set():
            sent = time.time()
            try:
                stream = self.client.completions.create(
                    model=self.model,
                    prompt=PROMPT,
                    max_tokens=MAX_TOKENS,
                    temperature=self.temperature,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                finish, text, tokens = None, "", None
                for chunk in stream:
                    for choice in chunk.choices or []:
                        text += choice.text or ""
                        finish = choice.finish_reason or finish
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                if finish is None:
                    self.failures.append("stream ended without a finish reason")
                elif finish == "length" and tokens is not None and tokens != MAX_TOKENS:
                    self.failures.append(f"truncated: {tokens} of {MAX_TOKENS} tokens with finish 'length'")
                else:
                    self.texts.append((sent, time.time(), text))
                    self.completed += 1
            except Exception as exc:  # noqa: BLE001 - every failure is the finding
                self.failures.append(f"{type(exc).__name__}: {exc}")


def _switch_and_drain(endpoint: Endpoint, clients: list[StreamingClient], **fields) -> Switch:
    """Change the policy (a blue/green switch), wait until it is done, the clients completed requests on the
    new instance and the old instance drained and stopped."""
    old = _active(endpoint)
    before = Switch.objects.filter(managed__endpoint=endpoint).count()
    update_policy(endpoint=endpoint, **fields)
    assert Switch.objects.filter(managed__endpoint=endpoint).count() == before + 1
    switch = Switch.objects.filter(managed__endpoint=endpoint).order_by("-pk").first()
    wait_for(
        f"the switch to {fields}",
        lambda: (
            Switch.objects.filter(pk=switch.pk)
            .exclude(status__in=[SwitchStatus.PENDING, SwitchStatus.STARTING])
            .exists()
        ),
    )
    switch.refresh_from_db()
    assert switch.status == SwitchStatus.DONE, switch.reason
    served_before = sum(c.completed for c in clients)
    wait_for("requests after the switch", lambda: sum(c.completed for c in clients) >= served_before + CLIENTS, 300)
    wait_for(
        "the old instance to drain and stop",
        lambda: ServerInstance.objects.filter(pk=old.pk, state=InstanceState.STOPPED).exists(),
        180,
    )
    endpoint.refresh_from_db()
    new = _active(endpoint)
    assert new is not None and new.pk != old.pk and endpoint.base_url == new.base_url
    change = PolicyChange.objects.filter(policy=get_policy(endpoint=endpoint)).first()
    assert change.changed_by == fields["user"] and change.changes["switch"]["outcome"] == "done"
    assert change.changes["switch"]["duration_s"] > 0
    logger.info("managed switch to %s: done in %.1f s", switch.speculation or "plain", switch.duration_s)
    return switch


def _native_record(endpoint: Endpoint, gateway_client, mechanism: str) -> StageRecord:
    """A native prod record of this mechanism with acceptance and a multiplier (one more greedy request is sent:
    the streams' records may have started under a load no baseline bucket covers as well)."""
    native = StageRecord.objects.filter(endpoint=endpoint, action="speculated", path="native", mechanism=mechanism)
    gateway_client.completions.create(model=endpoint.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    return wait_for(
        f"a native {mechanism} record with a multiplier",
        lambda: native.filter(multiplier__isnull=False, acceptance_rate__isnull=False).first(),
        60,
    )


def _canary_refuses_speculation(endpoint: Endpoint, user) -> None:
    """The switch canary (on by default) catches vLLM's defect: the switch to prod (n-gram) is refused and
    rolled back, the plain instance keeps serving, the reason is in the history and on the page."""
    plain = _active(endpoint)
    update_policy(endpoint=endpoint, user=user, mode="prod", mechanism="ngram", k=3)
    switch = Switch.objects.filter(managed__endpoint=endpoint).order_by("-pk").first()
    assert switch.canary == {"outcome": "pending", "reason": ""}
    wait_for(
        "the canary's verdict",
        lambda: (
            Switch.objects.filter(pk=switch.pk)
            .exclude(status__in=[SwitchStatus.PENDING, SwitchStatus.STARTING])
            .exists()
        ),
    )
    switch.refresh_from_db()
    assert switch.status == SwitchStatus.FAILED, (
        f"the canary let prod (n-gram) through ({switch.canary}): if vLLM fixed its mixed-batch defect, the prod "
        "periods' greedy outputs below should now equal off's: assert that instead"
    )
    assert switch.canary["outcome"] == "failed" and switch.canary["mismatches"] > 0, switch.canary
    assert switch.canary["reference"] == "the old instance, without speculation"
    assert "wrong greedy output under mixed batches with speculation on" in switch.reason
    endpoint.refresh_from_db()
    assert _active(endpoint).pk == plain.pk and endpoint.base_url == plain.base_url
    policy = get_policy(endpoint=endpoint)
    assert policy.mode == "off"
    change = PolicyChange.objects.filter(policy=policy).first()
    assert change.changes["switch"]["outcome"] == "rolled back"
    assert change.changes["switch"]["canary"]["outcome"] == "failed"
    browser = Client()
    browser.force_login(user)
    page = browser.get(reverse("fleet:endpoint-detail", kwargs={"pk": endpoint.pk})).content.decode()
    assert "Prod refused by the switch canary" in page and "wrong greedy output under mixed batches" in page
    logger.info("switch canary: %s in %.1f s", switch.canary, switch.duration_s)


def test_managed_endpoint_lifecycle(managed_worker, demo_pair, gateway_client, user, tmp_path, settings):
    # given: a managed endpoint of the demo target
    endpoint = create_managed_endpoint(
        name="managed-demo",
        model_dir=str(demo_pair.target_dir),
        served_name="managed-demo-model",
        node_class=managed_worker.extra["node_class"],
        server_args={"dtype": "float32", "max_model_len": 1024, "enforce_eager": True},
        created_by=user,
    )
    draft = register_draft(name="demo-draft", kind="draft_model", path=str(demo_pair.draft_dir))
    # then: the supervisor starts it and routes the endpoint to it once probed
    first = wait_for("the first instance to serve", lambda: _active(endpoint))
    endpoint.refresh_from_db()
    assert endpoint.status == "ready", endpoint.status_reason
    assert endpoint.base_url == first.base_url
    assert endpoint.capabilities.get("native_speculation") is False
    reference = (
        gateway_client.completions.create(model=endpoint.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .text
    )
    assert reference
    # and: the supervisor measures the plain baseline of the multiplier, per concurrency bucket
    baseline = wait_for("the baseline", lambda: ManagedServer.objects.get(endpoint=endpoint).baseline.get("buckets"))
    assert set(baseline) == {"1", "4"} and all(v > 0 for v in baseline.values())

    # when: 8 clients stream while the mode goes off -> prod (n-gram) -> prod (draft model) -> off
    clients = [StreamingClient(gateway_client, endpoint.name, 0.0 if i % 2 == 0 else 0.7) for i in range(CLIENTS)]
    for client in clients:
        client.start()
    wait_for("requests before the first switch", lambda: sum(c.completed for c in clients) >= CLIENTS, 300)
    policy = get_policy(endpoint=endpoint)
    assert policy.mode == "off"
    _canary_refuses_speculation(endpoint, user)
    # and: with the canary off (read where the switch is requested, recorded with it) the switches go through
    settings.MANAGED_SWITCH_CANARY = False
    ngram = _switch_and_drain(endpoint, clients, user=user, mode="prod", mechanism="ngram", k=3)
    assert ngram.canary["outcome"] == "skipped"
    endpoint.refresh_from_db()
    assert endpoint.capabilities["native_speculation"] is True
    policy = get_policy(endpoint=endpoint)
    assert (policy.mode, policy.mechanism, policy.k, policy.path) == ("prod", "ngram", 3, "native")
    ngram_record = _native_record(endpoint, gateway_client, "ngram")
    assert "per-request metrics" in ngram_record.reason, ngram_record.reason  # per-request acceptance
    serving = _active(endpoint)

    # when (still streaming): a draft whose directory is gone on the node
    bad = DraftModel.objects.create(
        name="vanished",
        kind="draft_model",
        path=str(tmp_path / "vanished-draft"),
        tokenizer_fingerprint=endpoint.capabilities.get("tokenizer_fingerprint", ""),
    )
    update_policy(endpoint=endpoint, user=user, mechanism="draft_model", draft=bad, k=3)
    failed = wait_for(
        "the failed switch",
        lambda: Switch.objects.filter(managed__endpoint=endpoint, status=SwitchStatus.FAILED, pk__gt=ngram.pk).first(),
    )
    # then: rolled back, the reason recorded, the old instance still serving
    assert failed.reason and failed.canary["outcome"] == "skipped"  # the canary is off from here on
    policy = get_policy(endpoint=endpoint)
    assert (policy.mechanism, policy.draft_id) == ("ngram", None)
    assert PolicyChange.objects.filter(policy=policy).first().changes["switch"]["outcome"] == "rolled back"
    assert _active(endpoint).pk == serving.pk

    drafted = _switch_and_drain(endpoint, clients, user=user, mechanism="draft_model", draft=draft, k=3)
    policy = get_policy(endpoint=endpoint)
    assert (policy.mode, policy.mechanism, policy.draft_id, policy.path) == ("prod", "draft_model", draft.pk, "native")
    draft_record = _native_record(endpoint, gateway_client, "draft_model")
    off = _switch_and_drain(endpoint, clients, user=user, mode="off")
    # and: greedy requests of the last off period that began after its margin (the phases below count only those)
    back_at = off.finished_at.timestamp() + ROUTE_MARGIN_S
    wait_for(
        "greedy requests of the last off period",
        lambda: sum(sent > back_at for c in clients if c.temperature == 0 for sent, _, _ in list(c.texts)) >= 4,
        300,
    )
    assert (drafted.canary["outcome"], off.canary["outcome"]) == ("skipped", "not needed")
    for client in clients:
        client.stop.set()
    for client in clients:
        client.join(timeout=180)

    # then: no request failed, hung or was cut
    assert not any(c.is_alive() for c in clients)
    failures = [f for c in clients for f in c.failures]
    assert failures == [], failures[:3]
    assert (
        ManagedServer.objects.get(endpoint=endpoint).serving_speculation == {}
        and get_policy(endpoint=endpoint).mode == "off"
    )
    endpoint.refresh_from_db()
    assert endpoint.capabilities.get("native_speculation") is False
    for record in (ngram_record, draft_record):
        assert record.baseline_tok_s in baseline.values() and record.drafted_tokens > 0
        assert 0 <= record.acceptance_rate <= 1 and record.multiplier > 0
    logger.info(
        "managed switches under %d streams: %d requests, 0 failed; switch s: ngram %.1f, draft %.1f, off %.1f; "
        "records: ngram %.2f tok/s vs %.2f (x%.2f, acceptance %.2f), draft %.2f tok/s vs %.2f (x%.2f, acceptance %.2f)",
        CLIENTS,
        sum(c.completed for c in clients),
        ngram.duration_s,
        drafted.duration_s,
        off.duration_s,
        ngram_record.tok_s,
        ngram_record.baseline_tok_s,
        ngram_record.multiplier,
        ngram_record.acceptance_rate,
        draft_record.tok_s,
        draft_record.baseline_tok_s,
        draft_record.multiplier,
        draft_record.acceptance_rate,
    )

    # when: the server is killed while a client is mid-stream
    victim = _active(endpoint)
    started, outcome = threading.Event(), {}

    def stream_long() -> None:
        try:
            stream = gateway_client.completions.create(
                model=endpoint.name, prompt=PROMPT, max_tokens=512, temperature=0, stream=True
            )
            finish = None
            for chunk in stream:
                started.set()
                for choice in chunk.choices or []:
                    finish = choice.finish_reason or finish
            outcome["finish"] = finish
        except Exception as exc:  # noqa: BLE001 - the error the client sees is the finding
            outcome["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            started.set()

    reader = threading.Thread(target=stream_long, daemon=True)
    reader.start()
    assert started.wait(120) and not outcome, outcome
    os.killpg(victim.pid, signal.SIGKILL)
    reader.join(timeout=120)

    # then: nothing hangs; the client gets a clear error (or a complete plain answer), never a silent cut
    assert not reader.is_alive()
    if "error" in outcome:
        assert "stream" in outcome["error"].lower() or "upstream" in outcome["error"].lower(), outcome
    else:
        assert outcome.get("finish") in ("length", "stop"), outcome
    logger.info("client mid-stream when the server was killed: %s", outcome)
    # and: the exit is recorded with its log tail and a new instance serves
    exited = wait_for(
        "the exit to be recorded",
        lambda: endpoint.managed.events.filter(kind=EventKind.EXITED, instance_id=victim.pk).first(),
        60,
    )
    assert "signal 9" in exited.message and exited.exit_code == -9
    third = wait_for("the restarted instance", lambda: _active(endpoint))
    assert third.pk != victim.pk and third.speculation == victim.speculation
    assert endpoint.managed.events.filter(kind=EventKind.RESTARTING).exists()
    reply = gateway_client.completions.create(model=endpoint.name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert reply.choices[0].text == reference
    # and: the restart is on the endpoint page
    browser = Client()
    browser.force_login(user)
    page = browser.get(reverse("fleet:endpoint-detail", kwargs={"pk": endpoint.pk})).content.decode()
    assert "signal 9" in page and "restarting" in page

    # when: the endpoint is deleted, its server stops
    pid = third.pid
    Endpoint.objects.filter(pk=endpoint.pk).delete()
    wait_for("the server to stop", lambda: not _pid_alive(pid), 60)

    # then (checked last, so that every other finding above is known first): greedy outputs equal off's in both
    # off periods (the first one spans the switch the canary refused), whichever instance served them
    # A request belongs to the phase it ran in from start to end: one that straddles a switch's route move (its
    # finished_at, then the commit that moves the route a moment later, which the gateway learns at once) or began
    # within ROUTE_MARGIN_S after it may have been served by either instance: under this load a request reaches the
    # gateway seconds after it is sent, so one sent just before a switch can be served by the other instance.
    done_at = [s.finished_at.timestamp() for s in (ngram, drafted, off)]
    phases = ("off", "prod ngram", "prod draft_model", "off again")
    per_phase: dict[str, list[str]] = {phase: [] for phase in phases}
    straddling = 0
    for client in clients:
        if client.temperature == 0:
            for sent, ended, text in client.texts:
                if any(sent - ROUTE_MARGIN_S < t <= ended for t in done_at):
                    straddling += 1
                    continue
                per_phase[phases[sum(t < sent for t in done_at)]].append(text)
    logger.info("greedy requests across a switch (either instance may have served them): %d", straddling)
    differing = {p: [t for t in texts if t != reference] for p, texts in per_phase.items()}
    logger.info(
        "greedy outputs differing from off's, per phase: %s",
        {p: f"{len(differing[p])} of {len(texts)}" for p, texts in per_phase.items()},
    )
    assert all(per_phase.values()), {p: len(t) for p, t in per_phase.items()}
    # Off before and after the switches: a switch never alters what the plain server answers.
    assert not differing["off"] and not differing["off again"], (reference, differing["off"][:3])
    # The prod periods ran with the canary turned off: their greedy outputs carry the vLLM 0.32 (CPU build) defect
    # the canary caught above (greedy requests batched with temperature 0.7 ones come out different from plain;
    # reproduced without ACE: scripts/repro_vllm_mixed_batch.py, docs/BENCHMARKS.md). Logged, not asserted.
    prod = {p: f"{len(d)} of {len(per_phase[p])}" for p, d in differing.items() if p.startswith("prod")}
    logger.info("prod periods with the canary off, greedy outputs differing from off's: %s", prod)


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
