"""A throw-away PostgreSQL server for benches and tests: Debian's server binaries (scripts/setup.sh installs them),
a fresh cluster in a temp directory, fsync off, stopped and removed afterwards."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ace.processes import free_port

START_TIMEOUT_S = 60


def bin_dir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    return Path(found[-1]).parent if found else None


def _as_postgres_user(argv: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: drop to Debian's `postgres` user when we are root."""
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", "postgres", "--", *argv]


@contextlib.contextmanager
def throwaway_server(*, log: Path, database: str = "ace", options: str = "") -> Iterator[str]:
    """Start a server, create `database`, yield its URL; `log` receives the server's log (created fresh)."""
    binaries = bin_dir()
    if binaries is None:
        raise RuntimeError("PostgreSQL server binaries are missing: run scripts/setup.sh (apt-get install postgresql)")
    root = Path(tempfile.mkdtemp(prefix="ace-pg-"))
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        os.chown(log, user.pw_uid, user.pw_gid)
    port = free_port()
    run = {"check": True, "capture_output": True, "text": True, "timeout": START_TIMEOUT_S}
    initdb = [str(binaries / "initdb"), "-D", str(root / "data"), "-U", "postgres", "-A", "trust", "--no-sync"]
    subprocess.run(_as_postgres_user(initdb), **run)
    flags = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off {options}"
    pg_ctl = str(binaries / "pg_ctl")
    subprocess.run(
        _as_postgres_user([pg_ctl, "-D", str(root / "data"), "-o", flags, "-l", str(log), "-w", "start"]), **run
    )
    try:
        createdb = [str(binaries / "createdb"), "-h", "127.0.0.1", "-p", str(port), database]
        subprocess.run(_as_postgres_user(createdb), **run)
        yield f"postgresql://postgres@127.0.0.1:{port}/{database}"
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run(_as_postgres_user([pg_ctl, "-D", str(root / "data"), "-m", "immediate", "stop"]), **run)
        shutil.rmtree(root, ignore_errors=True)
