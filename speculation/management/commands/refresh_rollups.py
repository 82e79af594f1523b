"""Fill the dashboard's per-minute rollups now (page views do it lazily), or rebuild them from scratch.

    python manage.py refresh_rollups [--rebuild]

--rebuild forgets every rollup and sums all stage records again: needed only after records were imported
with timestamps older than the rollup watermark (a live stage never writes those).
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import BaseCommand

from speculation.selectors.rollup_store import rebuild_rollups, refresh_rollups


class Command(BaseCommand):
    help = "Sum closed minutes of stage records into the dashboard rollups (--rebuild: from scratch)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--rebuild", action="store_true")

    def handle(self, *args: Any, rebuild: bool, **options: Any) -> None:
        started = time.perf_counter()
        rows = rebuild_rollups() if rebuild else refresh_rollups()
        self.stdout.write(f"{rows} rollup rows written in {(time.perf_counter() - started) * 1000:.0f} ms")
