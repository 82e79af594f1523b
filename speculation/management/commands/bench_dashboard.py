"""Render the dashboard over many stage records in a throwaway database and time it.

    python manage.py bench_dashboard [--records 100000] [--repeat 5] [--json PATH]

Creates a fresh database (the test database of the configured engine, named apart from the test suite's),
loads N stage records spread over the last 24 hours on one endpoint (the worst case for its page) plus a
few other endpoints, renders the fleet overview, the endpoint page (day range, the default) and the
timeseries API through Django's test client, and reports the median of --repeat timed renders after one
warm-up render. The one-off rollup of the freshly loaded records (what the first page view after a bulk
import pays) is timed apart as rollup_backfill_ms. The database is destroyed afterwards.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from fleet.models import Endpoint, EndpointStatus
from fleet.permissions import ADMIN, grant_role
from speculation.models import Action, Mode, SpeculationPolicy, StageRecord
from speculation.selectors.rollup_store import refresh_rollups

BATCH = 5000  # rows per INSERT batch: large enough to amortise, small enough for SQLite's variable limit
EXTRA_ENDPOINTS = 4


@contextmanager
def _explicit_created_at():
    """Let bulk_create keep the created_at we give (the field is auto_now_add)."""
    field = StageRecord._meta.get_field("created_at")
    field.auto_now_add = False
    try:
        yield
    finally:
        field.auto_now_add = True


def _record(endpoint: Endpoint, i: int, now: Any, rng: random.Random) -> StageRecord:
    at = now - timedelta(seconds=rng.uniform(0, 86_400))
    k = 5
    if rng.random() < 0.05:
        return StageRecord(
            endpoint=endpoint,
            request_id=f"b{i}",
            created_at=at,
            mode=Mode.PROD,
            action=Action.SKIPPED,
            reason="logprobs requested",
        )
    prod = rng.random() < 0.5
    passes = rng.randint(5, 40)
    per_pos = [0] * k
    hist = [0] * (k + 1)
    accepted = 0
    for _ in range(passes):
        run = 0
        while run < k and rng.random() < 0.7:
            run += 1
        hist[run] += 1
        accepted += run
        for p in range(run):
            per_pos[p] += 1
    output = accepted + passes
    baseline = rng.uniform(8, 12)
    mult = rng.uniform(1.2, 2.6)
    return StageRecord(
        endpoint=endpoint,
        request_id=f"b{i}",
        created_at=at,
        mode=Mode.PROD if prod else Mode.SHADOW,
        action=Action.SPECULATED if prod else Action.WOULD_SPECULATE,
        path="remote" if prod else "",
        mechanism="draft_model",
        k=k,
        drafted_tokens=passes * k,
        accepted_tokens=accepted,
        target_passes=passes,
        per_position_acceptance=[count / passes for count in per_pos],
        accepted_length_hist=hist,
        acceptance_rate=accepted / (passes * k),
        alpha=0.7,
        mean_accepted_len=output / passes,
        output_tokens=output,
        tok_s=baseline * mult if prod else None,
        baseline_tok_s=baseline if prod else None,
        multiplier=mult,
        latency_ms=rng.uniform(50, 900),
    )


def seed(*, records: int, seed_value: int = 0) -> Endpoint:
    """N records on one main endpoint (last 24 h) and a few on other endpoints; returns the main one."""
    rng = random.Random(seed_value)
    now = timezone.now()
    main = Endpoint.objects.create(name="bench-main", base_url="http://127.0.0.1:9/", status=EndpointStatus.READY)
    others = [
        Endpoint.objects.create(name=f"bench-{i}", base_url="http://127.0.0.1:9/", status=EndpointStatus.READY)
        for i in range(EXTRA_ENDPOINTS)
    ]
    for endpoint in [main, *others]:
        SpeculationPolicy.objects.create(endpoint=endpoint, mode=Mode.SHADOW)
    with _explicit_created_at():
        for start in range(0, records, BATCH):
            batch = [_record(main, i, now, rng) for i in range(start, min(records, start + BATCH))]
            StageRecord.objects.bulk_create(batch, batch_size=BATCH)
        StageRecord.objects.bulk_create([_record(e, -j, now, rng) for j, e in enumerate(others * 50)])
    return main


def _time_get(client: Client, url: str, repeat: int) -> float:
    response = client.get(url)  # warm-up: template compilation, first connection
    if response.status_code != 200:
        raise CommandError(f"GET {url} answered {response.status_code}")
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        response = client.get(url)
        if hasattr(response, "render") and not response.is_rendered:
            response.render()
        _ = response.content
        samples.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(samples), 1)


class Command(BaseCommand):
    help = "Time the dashboard pages and the timeseries API over N stage records in a throwaway database."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--records", type=int, default=100_000)
        parser.add_argument("--repeat", type=int, default=5)
        parser.add_argument("--json", dest="json_path", default="")

    def handle(self, *args: Any, records: int, repeat: int, json_path: str, **options: Any) -> None:
        if records < 1 or repeat < 1:
            raise CommandError("--records and --repeat must be >= 1")
        tmpdir = tempfile.TemporaryDirectory(prefix="ace-bench-dashboard-")
        test_settings = connection.settings_dict.setdefault("TEST", {})
        previous_test_name = test_settings.get("NAME")
        if connection.vendor == "sqlite":
            test_settings["NAME"] = str(Path(tmpdir.name) / "bench.sqlite3")
        else:
            test_settings["NAME"] = "ace_bench_dashboard"
        old_name = connection.settings_dict["NAME"]
        connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
        try:
            result = self._run(records=records, repeat=repeat)
        finally:
            connection.creation.destroy_test_db(old_name, verbosity=0)
            test_settings["NAME"] = previous_test_name
            tmpdir.cleanup()
        text = json.dumps(result, indent=2)
        self.stdout.write(text)
        if json_path:
            Path(json_path).write_text(text + "\n")

    def _run(self, *, records: int, repeat: int) -> dict:
        started = time.perf_counter()
        main = seed(records=records)
        seed_s = time.perf_counter() - started
        started = time.perf_counter()
        rolled_rows = refresh_rollups()  # what the first page view after a bulk import would pay
        backfill_ms = (time.perf_counter() - started) * 1000
        user = get_user_model().objects.create_user("bench", password="bench-password-0")
        grant_role(user=user, role=ADMIN)  # sees every seeded endpoint, like the run command's admin
        client = Client()
        client.force_login(user)
        timeseries = reverse("dashboard-api:endpoint-timeseries", args=[main.pk])
        return {
            "records": StageRecord.objects.count(),
            "records_main_endpoint": StageRecord.objects.filter(endpoint=main).count(),
            "database": connection.vendor,
            "repeat": repeat,
            "seed_s": round(seed_s, 1),
            "rollup_backfill_ms": round(backfill_ms, 1),
            "rollup_rows": rolled_rows,
            "overview_ms": _time_get(client, reverse("speculation:overview"), repeat),
            "endpoint_page_ms": _time_get(
                client, reverse("speculation:endpoint", args=[main.pk]) + "?range=day", repeat
            ),
            "timeseries_api_ms": _time_get(client, f"{timeseries}?metric=acceptance_rate&range=day", repeat),
            "debug": settings.DEBUG,
        }
