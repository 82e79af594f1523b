"""Render the dashboard over many stage records in a throwaway database and time it.

    python manage.py bench_dashboard [--records 100000] [--days 1] [--database sqlite|postgresql] [--repeat 5]
                                     [--json PATH]

Creates a fresh database (the test database of the configured engine, named apart from the test suite's; with
--database postgresql, a throw-away PostgreSQL server, speculation.bench.postgres), loads N stage records spread
over the last --days days on one endpoint (the worst case for its page) plus a few other endpoints, renders the
fleet overview, the endpoint page (day range, the default; its overview, then each of its views) and the
timeseries API through Django's test client, and
reports the median of --repeat timed renders after one warm-up render. The one-off rollup of the freshly loaded
records (what the first page view after a bulk import pays) is timed apart as rollup_backfill_ms. The database is
destroyed afterwards.

Loading is done by the database: a few thousand varied records are made in Python, and the rest copied from them
with fresh request ids and times (one INSERT ... SELECT over a number series per million rows), so 10 million rows
load in minutes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
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
from speculation.bench.postgres import throwaway_server
from speculation.models import Action, Mode, SpeculationPolicy, StageRecord
from speculation.selectors.rollup_store import refresh_rollups
from speculation.web.endpoint_page import VIEWS

BATCH = 5000  # rows per INSERT batch: large enough to amortise, small enough for SQLite's variable limit
EXTRA_ENDPOINTS = 4
TEMPLATES = 2000  # records made in Python; the rest are copies of them
COPY_ROWS = 1_000_000  # rows per INSERT ... SELECT
DATABASES = ("sqlite", "postgresql")


@contextmanager
def _explicit_created_at():
    """Let bulk_create keep the created_at we give (the field is auto_now_add)."""
    field = StageRecord._meta.get_field("created_at")
    field.auto_now_add = False
    try:
        yield
    finally:
        field.auto_now_add = True


def _record(endpoint: Endpoint, i: int, now: Any, rng: random.Random, span_s: float = 86_400) -> StageRecord:
    at = now - timedelta(seconds=rng.uniform(0, span_s))
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


def seed(*, records: int, days: float = 1, seed_value: int = 0) -> Endpoint:
    """N records on one main endpoint (the last `days` days) and a few on other endpoints; returns the main one."""
    rng = random.Random(seed_value)
    now = timezone.now()
    span_s = days * 86_400
    main = Endpoint.objects.create(name="bench-main", base_url="http://127.0.0.1:9/", status=EndpointStatus.READY)
    others = [
        Endpoint.objects.create(name=f"bench-{i}", base_url="http://127.0.0.1:9/", status=EndpointStatus.READY)
        for i in range(EXTRA_ENDPOINTS)
    ]
    for endpoint in [main, *others]:
        SpeculationPolicy.objects.create(endpoint=endpoint, mode=Mode.SHADOW)
    templates = min(records, TEMPLATES)
    with _explicit_created_at():
        for start in range(0, templates, BATCH):
            batch = [_record(main, i, now, rng, span_s) for i in range(start, min(templates, start + BATCH))]
            StageRecord.objects.bulk_create(batch, batch_size=BATCH)
        StageRecord.objects.bulk_create([_record(e, -j, now, rng, span_s) for j, e in enumerate(others * 50)])
    _copy(main, count=records - templates, templates=templates, now_s=now.timestamp(), span_s=span_s)
    return main


# numbers start..stop as q(i), and a time (epoch seconds x) as the column's value, per database
_SERIES = {
    "postgresql": "generate_series(%s, %s) AS q(i)",
    "sqlite": "(WITH RECURSIVE n(i) AS (SELECT %s UNION ALL SELECT i + 1 FROM n WHERE i < %s) SELECT i FROM n) AS q",
}
_AT = {
    "postgresql": "to_timestamp(s.x)",
    "sqlite": "strftime('%%Y-%%m-%%d %%H:%%M:%%S', s.x, 'unixepoch') "
    "|| printf('.%%06d', CAST((s.x - CAST(s.x AS INTEGER)) * 1000000 AS INTEGER))",
}


def _copy(main: Endpoint, *, count: int, templates: int, now_s: float, span_s: float) -> None:
    """`count` more records on `main`, each a copy of template i % templates with request id c<i> and a time
    spread evenly over the span (the newest last, as ids grow with time in a live stage)."""
    if count <= 0:
        return
    table = StageRecord._meta.db_table
    fields = [f for f in StageRecord._meta.concrete_fields if f.name != "id"]
    names = ", ".join(f.column for f in fields)
    copied = {"request_id": "'c' || s.i", "created_at": "{at}"}
    picked = ", ".join(copied.get(f.attname, f"t.{f.column}") for f in fields)
    ids = list(StageRecord.objects.filter(endpoint=main).order_by("id").values_list("id", flat=True)[:templates])
    if ids[-1] - ids[0] + 1 != templates:
        raise CommandError("the template records' ids are not contiguous; load into a fresh database")
    step = span_s / count
    with connection.cursor() as cursor:
        cursor.execute("DROP TABLE IF EXISTS bench_template")
        cursor.execute(f"CREATE TEMPORARY TABLE bench_template AS SELECT * FROM {table} WHERE id <= %s", [ids[-1]])
        cursor.execute("CREATE INDEX bench_template_id ON bench_template (id)")
        for start in range(0, count, COPY_ROWS):
            stop = min(count, start + COPY_ROWS)
            sql = (
                f"INSERT INTO {table} ({names}) SELECT {picked.format(at=_AT[connection.vendor])} "
                f"FROM (SELECT i, %s - (%s - i) * %s AS x FROM {_SERIES[connection.vendor]}) AS s "
                f"JOIN bench_template t ON t.id = %s + (s.i %% %s)"
            )
            cursor.execute(sql, [now_s, count - 1, step, start, stop - 1, ids[0], templates])
        cursor.execute("DROP TABLE bench_template")


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
        parser.add_argument("--days", type=float, default=1.0, help="the span the records are spread over")
        parser.add_argument(
            "--database",
            choices=DATABASES,
            default="",
            help="sqlite: a temp file; postgresql: a throw-away server (default: the configured database's engine)",
        )
        parser.add_argument("--repeat", type=int, default=5)
        parser.add_argument("--json", dest="json_path", default="")

    def handle(
        self, *args: Any, records: int, days: float, database: str, repeat: int, json_path: str, **options: Any
    ) -> None:
        if records < 1 or repeat < 1 or not days > 0:
            raise CommandError("--records and --repeat must be >= 1 and --days > 0")
        if database and database != connection.vendor:
            self._elsewhere(database, records=records, days=days, repeat=repeat, json_path=json_path)
            return
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
            result = self._run(records=records, days=days, repeat=repeat)
        finally:
            connection.creation.destroy_test_db(old_name, verbosity=0)
            test_settings["NAME"] = previous_test_name
            tmpdir.cleanup()
        text = json.dumps(result, indent=2)
        self.stdout.write(text)
        if json_path:
            Path(json_path).write_text(text + "\n")

    def _elsewhere(self, database: str, *, records: int, days: float, repeat: int, json_path: str) -> None:
        """Run this command again in a process configured for the other database (settings are read once)."""
        argv = [sys.executable, "manage.py", "bench_dashboard", f"--records={records}", f"--days={days}"]
        argv += [f"--repeat={repeat}", f"--database={database}"] + ([f"--json={json_path}"] if json_path else [])
        with contextlib.ExitStack() as stack:
            if database == "postgresql":
                log = Path(settings.BASE_DIR) / "test-artifacts" / "bench_dashboard_postgres.log"
                url = stack.enter_context(throwaway_server(log=log, options="-c shared_buffers=512MB"))
            else:
                url = f"sqlite:///{stack.enter_context(tempfile.TemporaryDirectory())}/bench.sqlite3"
            env = {**os.environ, "DATABASE_URL": url}
            env.pop("ACE_TEST_DATABASE", None)
            done = subprocess.run(argv, env=env, cwd=settings.BASE_DIR, stdout=subprocess.PIPE, text=True)
        self.stdout.write(done.stdout.rstrip("\n"))
        if done.returncode:
            raise CommandError(f"the bench on {database} failed (exit {done.returncode})")

    def _run(self, *, records: int, days: float, repeat: int) -> dict:
        started = time.perf_counter()
        main = seed(records=records, days=days)
        seed_s = time.perf_counter() - started
        started = time.perf_counter()
        rolled_rows = refresh_rollups()  # what the first page view after a bulk import would pay
        backfill_ms = (time.perf_counter() - started) * 1000
        user = get_user_model().objects.create_user("bench", password="bench-password-0")
        grant_role(user=user, role=ADMIN)  # sees every seeded endpoint, like the run command's admin
        client = Client()
        client.force_login(user)
        timeseries = reverse("dashboard-api:endpoint-timeseries", args=[main.pk])
        page = reverse("speculation:endpoint", args=[main.pk])
        return {
            "records": StageRecord.objects.count(),
            "records_main_endpoint": StageRecord.objects.filter(endpoint=main).count(),
            "database": connection.vendor,
            "days": days,
            "repeat": repeat,
            "seed_s": round(seed_s, 1),
            "rollup_backfill_ms": round(backfill_ms, 1),
            "rollup_rows": rolled_rows,
            "overview_ms": _time_get(client, reverse("speculation:overview"), repeat),
            "endpoint_page_ms": _time_get(client, f"{page}?range=day", repeat),  # the overview, its default view
            "endpoint_views_ms": {view: _time_get(client, f"{page}?range=day&view={view}", repeat) for view in VIEWS},
            "timeseries_api_ms": _time_get(client, f"{timeseries}?metric=acceptance_rate&range=day", repeat),
            "debug": settings.DEBUG,
        }
