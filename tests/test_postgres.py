"""The PostgreSQL path: a real Debian PostgreSQL server started here, migrations applied, and the probe-service
tests run again with DATABASE_URL pointing at it (in a subprocess, since settings are read once per process)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from ace.processes import REPO_ROOT, free_port

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

PG_START_TIMEOUT_S = 60


def _pg_bin() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def _as_postgres_user(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: drop to Debian's `postgres` user when we are root."""
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.fail("PostgreSQL server binaries are missing: run scripts/setup.sh (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="ace-pg-"))
    data, log = root / "data", REPO_ROOT / "test-artifacts" / "postgres.log"
    log.parent.mkdir(exist_ok=True)
    log.write_text("")  # fresh for this run: a test reads it
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        os.chown(log, user.pw_uid, user.pw_gid)
    port = free_port()
    run = {"check": True, "capture_output": True, "text": True, "timeout": PG_START_TIMEOUT_S}
    subprocess.run(
        _as_postgres_user([str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync"]),
        **run,
    )
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
    options += " -c log_connections=on"  # the log shows which databases the tests used
    pg_ctl = str(bin_dir / "pg_ctl")
    subprocess.run(_as_postgres_user([pg_ctl, "-D", str(data), "-o", options, "-l", str(log), "-w", "start"]), **run)
    try:
        subprocess.run(_as_postgres_user([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "ace"]), **run)
        yield f"postgresql://postgres@127.0.0.1:{port}/ace"
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run(_as_postgres_user([pg_ctl, "-D", str(data), "-m", "immediate", "stop"]), **run)
        shutil.rmtree(root, ignore_errors=True)


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
