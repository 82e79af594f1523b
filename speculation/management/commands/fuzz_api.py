"""Fuzz ACE's REST API (from its OpenAPI schema, with schemathesis) and the gateway's bodies; count 5xx and
tracebacks. Starts its own Redis, throw-away database, vLLM (demo target) and ACE under uvicorn.

    python manage.py fuzz_api --quick --json fuzz.json     # a few minutes
    python manage.py fuzz_api --json fuzz.json             # every single-field change, 40 cases per operation
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from ace import fuzz


class Command(BaseCommand):
    help = "Fuzz the REST API and the gateway against ACE under uvicorn; print and write 5xx / traceback counts."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--quick", action="store_true", help="a seeded sample (the CI form)")
        parser.add_argument("--json", type=Path, help="write the full report here")
        parser.add_argument("--upstream", default="", help="an OpenAI-compatible server to use instead of vLLM")
        parser.add_argument("--only", choices=["rest", "gateway"], help="fuzz one surface only")

    def handle(self, *args, **opts) -> None:
        started = time.monotonic()
        with fuzz.FuzzStack(upstream=opts["upstream"]) as stack:
            self.stdout.write(f"ACE {stack.ace_url}, model server {stack.upstream}, logs {stack.log_dir}")
            report = fuzz.run(
                stack, quick=opts["quick"], rest=opts["only"] != "gateway", gateway=opts["only"] != "rest"
            )
        report["seconds"] = round(time.monotonic() - started, 1)
        report["machine"] = f"{platform.node()} {platform.machine()}, {platform.python_version()}"
        report["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        self._print(report)
        if opts["json"]:
            opts["json"].write_text(json.dumps(report, indent=2) + "\n")
            self.stdout.write(f"wrote {opts['json']}")
        if not report["ok"]:
            raise CommandError(f"{report['server_errors']} 5xx answers, {report['log_tracebacks']} tracebacks")

    def _print(self, report: dict) -> None:
        self.stdout.write(f"{'surface':<10} {'requests':>9} {'5xx':>5}  statuses")
        for part in fuzz.PARTS:
            if part in report:
                r = report[part]
                self.stdout.write(f"{part:<10} {r['requests']:>9} {r['server_errors']:>5}  {r['statuses']}")
        self.stdout.write(f"tracebacks in ACE's log: {report['log_tracebacks']}")
        for part in fuzz.PARTS:
            for finding in report.get(part, {}).get("findings", [])[:10]:
                self.stdout.write(f"  {part}: {finding}")
