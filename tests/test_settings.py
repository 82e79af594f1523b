"""Settings come from the environment with safe defaults; a bad value stops start-up naming the variable.

Each case starts a fresh interpreter, as a real start-up would (settings are read once per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ace.processes import REPO_ROOT

SHOW_SETTINGS = """
import json, django
django.setup()
from django.conf import settings as s
db = s.DATABASES["default"]
print(json.dumps({
    "debug": s.DEBUG, "engine": db["ENGINE"], "db_name": str(db["NAME"]), "db_host": db.get("HOST", ""),
    "redis": s.REDIS_URL, "broker": s.CELERY_BROKER_URL, "networks": [str(n) for n in s.ALLOWED_ENDPOINT_NETWORKS],
    "probe_timeout": s.PROBE_TIMEOUT_S, "prefetch": s.CELERY_WORKER_PREFETCH_MULTIPLIER,
    "beat": {k: v["task"] for k, v in s.CELERY_BEAT_SCHEDULE.items()},
}))
"""


def start_up(tmp_path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ACE_", "DATABASE_URL", "REDIS_URL"))}
    clean.update({"DJANGO_SETTINGS_MODULE": "ace.settings", "ACE_DATA_DIR": str(tmp_path), **env})
    return subprocess.run(
        [sys.executable, "-c", SHOW_SETTINGS], env=clean, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )


def test_embedded_defaults_are_safe(tmp_path):
    result = start_up(tmp_path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["debug"] is False
    assert shown["engine"].endswith("sqlite3")
    assert shown["db_name"].startswith(str(tmp_path))
    assert shown["redis"] == shown["broker"] == "redis://127.0.0.1:6379/0"
    assert "127.0.0.0/8" in shown["networks"] and "10.0.0.0/8" in shown["networks"]
    assert not any(n.startswith("169.254") for n in shown["networks"])
    assert shown["prefetch"] == 1
    assert "fleet.tasks.reprobe_all_task" in shown["beat"].values()
    assert "speculation.tasks.refresh_rollups_task" in shown["beat"].values()


def test_database_url_selects_postgresql(tmp_path):
    result = start_up(tmp_path, DATABASE_URL="postgresql://ace:pw@db.internal:5432/ace")
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["engine"] == "django.db.backends.postgresql"
    assert (shown["db_name"], shown["db_host"]) == ("ace", "db.internal")


def test_environment_values_are_used(tmp_path):
    result = start_up(
        tmp_path,
        ACE_DEBUG="true",
        REDIS_URL="redis://10.1.2.3:6380/2",
        ACE_PROBE_TIMEOUT="2.5",
        ACE_ALLOWED_ENDPOINT_NETWORKS="10.0.0.0/8, 169.254.169.254/32",
    )
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["debug"] is True
    assert shown["broker"] == "redis://10.1.2.3:6380/2"
    assert shown["probe_timeout"] == 2.5
    assert shown["networks"] == ["10.0.0.0/8", "169.254.169.254/32"]


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("ACE_DEBUG", "maybe"),
        ("DATABASE_URL", "mysql://u:p@h/db"),
        ("REDIS_URL", "http://127.0.0.1:6379"),
        ("ACE_ALLOWED_ENDPOINT_NETWORKS", "not-a-network"),
        ("ACE_PROBE_TIMEOUT", "soon"),
        ("ACE_PROBE_TIMEOUT", "0"),
        ("ACE_SECRET_KEY", "short"),
        ("ACE_ENCRYPTION_KEY", "not-a-fernet-key"),
        ("ACE_RECORD_RETENTION", "7"),  # no unit
        ("ACE_RECORD_RETENTION", "30m"),  # under an hour
        ("ACE_ROLLUP_RETENTION", "2d"),  # shorter than the dashboard's week
        ("ACE_RECORD_QUEUE", "0"),
    ],
)
def test_a_bad_value_stops_start_up_naming_the_variable(tmp_path, variable, value):
    result = start_up(tmp_path, **{variable: value})
    assert result.returncode != 0
    assert "ConfigError" in result.stderr
    assert variable in result.stderr.strip().splitlines()[-1]


def test_a_database_password_is_not_echoed_in_the_error(tmp_path):
    result = start_up(tmp_path, DATABASE_URL="mysql://user:hunter2secret@h/db")
    assert result.returncode != 0
    assert "hunter2secret" not in result.stderr


def test_durations_read_with_their_unit():
    from datetime import timedelta

    from ace.env import env_duration

    os.environ["ACE_TEST_DURATION"] = "36h"
    try:
        assert env_duration("ACE_TEST_DURATION", "7d") == timedelta(hours=36)
    finally:
        del os.environ["ACE_TEST_DURATION"]
    assert env_duration("ACE_TEST_DURATION", "7d") == timedelta(days=7)


@pytest.mark.parametrize(("name", "value"), [("ACE_ENGINE_DEVICE", "tpu"), ("ACE_ENGINE_DTYPE", "int8")])
def test_an_engine_device_or_dtype_it_cannot_use_stops_start_up_naming_the_variable(tmp_path, name, value):
    result = start_up(tmp_path, **{name: value})

    assert result.returncode != 0
    assert f"{name}={value!r}" in result.stderr
