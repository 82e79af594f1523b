"""The PostgreSQL path: a real Debian PostgreSQL server started here, migrations applied, and the probe-service
tests run again with DATABASE_URL pointing at it (in a subprocess, since settings are read once per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from ace.processes import REPO_ROOT
from speculation.bench.postgres import bin_dir, throwaway_server

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    if bin_dir() is None:
        pytest.fail("PostgreSQL server binaries are missing: run scripts/setup.sh (apt-get install postgresql)")
    log = REPO_ROOT / "test-artifacts" / "postgres.log"  # fresh for this run: a test reads it
    with throwaway_server(log=log, options="-c log_connections=on") as url:  # the log shows the databases used
        yield url


def _with_database(url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("ACE_TEST_DATABASE", "PYTEST_ADDOPTS")}
    return {**env, "DATABASE_URL": url, "DJANGO_SETTINGS_MODULE": "ace.settings"}


def test_migrations_apply_to_postgresql(postgres_url):
    result = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput"],
        env=_with_database(postgres_url), cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    shown = subprocess.run(
        [sys.executable, "manage.py", "showmigrations", "--plan"],
        env=_with_database(postgres_url), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert "[ ]" not in shown.stdout
    assert "[X]  fleet.0001_initial" in shown.stdout


def test_the_probe_service_tests_pass_on_postgresql(postgres_url):
    vendor = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); from django.db import connection as c; print(c.vendor)"],
        env=_with_database(postgres_url), cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert vendor.stdout.strip() == "postgresql", vendor.stderr
    # The probe service's own tests: endpoint/probe create, run, record, re-probe, broker down; on PostgreSQL.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/fleet/test_probing.py"],
        env=_with_database(postgres_url), cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
    # and they really ran on this server: pytest-django created and used its test database here
    assert "database=test_ace" in (REPO_ROOT / "test-artifacts" / "postgres.log").read_text()
