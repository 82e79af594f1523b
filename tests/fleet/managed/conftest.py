"""Shared fixtures of the managed endpoint tests: a stand-in managed endpoint and its first instance (no server
process), and for the real-vLLM tests an admin, its token, the openai client pointed at ACE under uvicorn and a real
Celery worker running the supervisor."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from ace import processes
from fleet.adapters import ProbeReport
from fleet.managed import switching
from fleet.managed.models import InstanceRole, InstanceState, ServerInstance
from fleet.managed.services import create_managed_endpoint
from fleet.models import Endpoint
from fleet.permissions import ADMIN, OPERATOR, grant_role
from tests.support.stack import database_url, start_ace

MANAGED_NODE_CLASS = "managedtest"  # the GPU queue managed_worker consumes


@pytest.fixture
def operator():
    user = get_user_model().objects.create_user(username="managed-ops", password="pw-ops-123456")
    grant_role(user=user, role=OPERATOR)
    return user


@pytest.fixture
def managed_endpoint(tmp_path: Path, operator) -> Endpoint:
    """A managed endpoint of a stand-in model directory (no server is started)."""
    directory = tmp_path / "managed-target"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return create_managed_endpoint(name="managed", model_dir=str(directory), created_by=operator, node_class="cpu")


@pytest.fixture
def serving() -> Callable[..., ServerInstance]:
    """Route an endpoint to a first instance, as the supervisor leaves it once that instance serves."""

    def route(endpoint: Endpoint, port: int = 41001) -> ServerInstance:
        instance = ServerInstance.objects.create(
            managed=endpoint.managed, role=InstanceRole.ACTIVE, state=InstanceState.STARTING, port=port
        )
        report = ProbeReport(
            capabilities={"served_model": "m", "tokenizer_fingerprint": "f" * 64, "native_speculation": False}
        )
        switching.activate(instance=instance, report=report, duration_ms=5.0, started=instance.started_at)
        endpoint.refresh_from_db()
        instance.refresh_from_db()
        return instance

    return route


@pytest.fixture
def user():
    """An admin (test_managed_switch.py: the switches are about the server, not ownership)."""
    user = get_user_model().objects.create_user(username="managed-admin", password="pw-for-tests-only")
    grant_role(user=user, role=ADMIN)
    return user


@pytest.fixture(scope="session")
def managed_ace_server(django_db_setup, redis_server, artifacts_dir: Path) -> Iterator[processes.ManagedProcess]:
    proc = start_ace(redis_url=redis_server.url, log_dir=artifacts_dir, name="ace-uvicorn-managed")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def gateway_client(managed_ace_server, user):
    """The official openai client pointed at ACE, with the admin's token."""
    import openai
    from rest_framework.authtoken.models import Token

    token = Token.objects.create(user=user).key
    return openai.OpenAI(base_url=managed_ace_server.url + "/v1", api_key=token, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def managed_worker(django_db_setup, django_db_blocker, redis_server, artifacts_dir: Path) -> Iterator:
    """A real `celery worker` consuming gpu.<node class> (``.extra["node_class"]``): it starts the supervisor of
    that node class, and runs the shadow and prod jobs of its endpoints."""
    env = {
        "DATABASE_URL": database_url(),
        "REDIS_URL": redis_server.url,
        "DJANGO_SETTINGS_MODULE": "ace.settings",
        "ACE_CELERY_EAGER": "false",
        "ACE_MANAGED_SUPERVISOR": "true",
        "ACE_MANAGED_START_TIMEOUT": "420",
    }
    proc = processes.start_celery_worker(
        env=env, log_dir=artifacts_dir, queues=f"gpu.{MANAGED_NODE_CLASS}", name="managed-worker"
    )
    proc.extra["node_class"] = MANAGED_NODE_CLASS
    try:
        yield proc
    finally:
        proc.stop(grace_s=40)
