"""Fallbacks: whatever breaks on the speculative path, the client gets the correct (plain) answer and the stage
record says fell_back and why. Real processes are broken for real: a worker killed mid-stream, Redis stopped,
a draft whose weights are corrupt. This module starts its own Redis, ACE and worker so that breaking them
leaves the session's shared ones alone."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from ace import processes
from speculation.models import StageRecord
from speculation.services.drafts import register_draft
from speculation.services.policies import update_policy
from tests.support.stack import database_url, register_probed_endpoint, start_ace

pytestmark = [pytest.mark.vllm, pytest.mark.worker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

QUEUE_CLASS = "fallback"
PROMPT = "def fibonacci(n):"


@pytest.fixture
def own_redis(tmp_path: Path, artifacts_dir: Path):
    proc = processes.start_redis(workdir=tmp_path / "redis", log_dir=tmp_path)
    yield proc
    proc.stop()


@pytest.fixture
def own_ace(own_redis, tmp_path: Path):
    proc = start_ace(
        redis_url=own_redis.url,
        log_dir=tmp_path,
        name="ace-fallback",
        extra_env={"ACE_PROD_START_TIMEOUT": "8", "ACE_PROD_STEP_TIMEOUT": "10"},
    )
    yield proc
    proc.stop()


def _start_worker(own_redis, tmp_path: Path) -> processes.ManagedProcess:
    env = {
        "DATABASE_URL": database_url(),
        "REDIS_URL": own_redis.url,
        "DJANGO_SETTINGS_MODULE": "ace.settings",
        "ACE_CELERY_EAGER": "false",
    }
    return processes.start_celery_worker(env=env, log_dir=tmp_path, queues=f"gpu.{QUEUE_CLASS}", name="fb-worker")


@pytest.fixture
def client(own_ace, token):
    import openai

    return openai.OpenAI(base_url=own_ace.url + "/v1", api_key=token, max_retries=0, timeout=120)


@pytest.fixture
def endpoint(vllm_server):
    return register_probed_endpoint(name="demo-fb", base_url=vllm_server.base_url, node_class=QUEUE_CLASS)


def _bump(own_redis) -> None:
    import redis

    from speculation.services.version import BUMP_LUA, ROUTING_VERSION_KEY, VERSION_CHANNEL

    # as the product bumps it: INCR and PUBLISH (a gateway following the channel reads no counter per request)
    redis.Redis.from_url(own_redis.url).eval(BUMP_LUA, 1, ROUTING_VERSION_KEY, VERSION_CHANNEL)


def _prod(endpoint, draft, own_redis, **extra) -> None:
    update_policy(endpoint=endpoint, mode="prod", mechanism="draft_model", draft=draft, **{"k": 3, **extra})
    _bump(own_redis)  # update_policy bumped the session's Redis; this ACE reads its own


def _chat(client, model: str, *, stream: bool, max_tokens: int = 16) -> list[int]:
    kwargs = dict(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0].model_extra["token_ids"]
    ids: list[int] = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            ids += chunk.choices[0].model_extra.get("token_ids") or []
    return ids


def _warm(client, endpoint, timeout_s: float = 120.0) -> None:
    """Until the worker has served a prod request (models loaded), however loaded this machine is."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        StageRecord.objects.all().delete()
        _chat(client, endpoint.name, stream=False, max_tokens=2)
        if _last_record(endpoint).action == "speculated":
            StageRecord.objects.all().delete()
            return
    raise AssertionError("the worker never served a prod request")


def _last_record(endpoint, timeout_s: float = 30.0) -> StageRecord:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        record = StageRecord.objects.filter(endpoint=endpoint).order_by("-id").first()
        if record is not None:
            return record
        time.sleep(0.2)
    raise AssertionError("no stage record")


def test_no_worker_on_the_queue_falls_back_to_plain(client, endpoint, demo_pair, own_redis):
    expected = _chat(client, endpoint.name, stream=False)  # off
    draft = register_draft(name="d", kind="draft_model", path=str(demo_pair.draft_dir))
    _prod(endpoint, draft, own_redis)
    for stream in (False, True):
        StageRecord.objects.all().delete()
        assert _chat(client, endpoint.name, stream=stream) == expected
        record = _last_record(endpoint)
        assert record.action == "fell_back"
        assert "no worker on gpu.fallback" in record.reason


def test_a_worker_killed_mid_stream_is_finished_plainly(client, endpoint, demo_pair, own_redis, tmp_path):
    max_tokens = 600
    expected = _chat(client, endpoint.name, stream=False, max_tokens=max_tokens)
    assert len(expected) > 50  # long enough that the worker is still generating when it is killed
    draft = register_draft(name="d", kind="draft_model", path=str(demo_pair.draft_dir))
    worker = _start_worker(own_redis, tmp_path)
    try:
        _prod(endpoint, draft, own_redis, k=1)
        _warm(client, endpoint)
        ids: list[int] = []
        stream = client.chat.completions.create(
            model=endpoint.name,
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"return_token_ids": True},
        )
        for chunk in stream:
            if chunk.choices:
                ids += chunk.choices[0].model_extra.get("token_ids") or []
            if ids and worker.alive():
                os.killpg(worker.pid, signal.SIGKILL)  # at the first tokens, no warm shutdown
                worker.popen.wait(timeout=10)
    finally:
        worker.stop()
    assert ids == expected
    record = _last_record(endpoint)
    assert record.action == "fell_back", record.reason
    assert "worker sent nothing" in record.reason


def test_redis_down_falls_back_and_still_records(client, endpoint, demo_pair, own_redis):
    expected = _chat(client, endpoint.name, stream=False)
    draft = register_draft(name="d", kind="draft_model", path=str(demo_pair.draft_dir))
    _prod(endpoint, draft, own_redis)
    time.sleep(0.3)
    own_redis.stop()
    for stream in (False, True):
        StageRecord.objects.all().delete()
        assert _chat(client, endpoint.name, stream=stream) == expected
        record = _last_record(endpoint)
        assert record.action == "fell_back"
        assert "redis unavailable" in record.reason


def test_a_broken_draft_falls_back_with_a_draft_error(client, endpoint, demo_pair, own_redis, tmp_path):
    expected = _chat(client, endpoint.name, stream=False)
    broken = tmp_path / "broken-draft"
    shutil.copytree(demo_pair.draft_dir, broken)
    draft = register_draft(name="broken", kind="draft_model", path=str(broken))
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    worker = _start_worker(own_redis, tmp_path)
    try:
        good = register_draft(name="good", kind="draft_model", path=str(demo_pair.draft_dir))
        _prod(endpoint, good, own_redis)
        _warm(client, endpoint)
        _prod(endpoint, draft, own_redis)
        for stream in (False, True):
            StageRecord.objects.all().delete()
            assert _chat(client, endpoint.name, stream=stream) == expected
            record = _last_record(endpoint)
            assert record.action == "fell_back"
            assert "draft error" in record.reason
    finally:
        worker.stop()
