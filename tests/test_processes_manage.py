"""ace.processes.run_manage: what the benchmark, fault and fuzz stacks use to set up their own databases."""

from __future__ import annotations

import pytest

from ace import processes


def test_it_returns_the_commands_output(tmp_path):
    out = processes.run_manage("check", env={"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"})
    assert "System check identified no issues" in out


def test_a_failing_command_raises_with_its_output(tmp_path):
    with pytest.raises(RuntimeError, match="manage.py no_such_command failed") as failure:
        processes.run_manage("no_such_command", env={"DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}"})
    assert "Unknown command" in str(failure.value)
