"""The node's other processes' CPU, as a calibration reads it before timing the worker's own steps."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from speculation.worker import cpuload

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/stat")

SPIN = "import time\nend = time.monotonic() + 30\nwhile time.monotonic() < end: pass\n"


def test_another_process_spinning_a_core_is_seen_and_the_wait_gives_up_at_its_deadline():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.3)
        # a whole core, less what the machine's scheduler gives others (tolerance: CI shares its cores)
        assert cpuload.others_cores(0.3) > 0.6
        started = time.monotonic()
        assert cpuload.wait_until_quiet(deadline=started + 0.5, cores=0.5) is False
        assert 0.5 <= time.monotonic() - started < 1.5
    finally:
        spinner.kill()
        spinner.wait()


def test_this_processs_own_threads_are_not_counted():
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        # the calibration's own relay and loop thread are this process's: a quiet node reads well under a core
        readings = [cpuload.others_cores(0.2) for _ in range(3)]
        assert min(readings) < 0.5, readings
    finally:
        stop.set()
        thread.join()


def test_without_proc_stat_it_cannot_say_and_does_not_wait(monkeypatch):
    monkeypatch.setattr(cpuload, "_busy_s", lambda: None)
    assert cpuload.others_cores(0.01) is None
    started = time.monotonic()
    assert cpuload.wait_until_quiet(deadline=started + 5, cores=0.5) is False
    assert time.monotonic() - started < 0.5
