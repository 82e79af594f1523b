"""Per-category acceptance of every candidate on an endpoint, from Spec-Bench prompts (like its leaderboard).

    python manage.py calibrate ENDPOINT [--sample N] [--max-tokens M] [--json PATH]

ENDPOINT: the endpoint's name (or id). N prompts per Spec-Bench category (default 2) go to the endpoint's server
as greedy completions; every compatible candidate is replayed on each at K = 1..8 (speculation.worker.calibrate).
Bad arguments exit with status 2 and a message; an unreachable server is reported per prompt.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from fleet.models import Endpoint


def positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from exc
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


class Command(BaseCommand):
    help = "Replay every candidate on Spec-Bench prompts through ENDPOINT; print the per-category table."

    def add_arguments(self, parser) -> None:
        parser.add_argument("endpoint", help="the endpoint's name or id")
        parser.add_argument("--sample", type=positive_int, default=2, help="prompts per Spec-Bench category")
        parser.add_argument("--max-tokens", type=positive_int, default=64, help="greedy output tokens per prompt")
        parser.add_argument("--json", type=Path, help="write the table as JSON here too")

    def handle(self, *args: Any, endpoint: str, sample: int, max_tokens: int, json: Path | None, **options: Any):
        found = Endpoint.objects.filter(name=endpoint).first()
        if found is None and endpoint.isdigit():
            found = Endpoint.objects.filter(pk=int(endpoint)).first()
        if found is None:
            raise CommandError(f"no endpoint named {endpoint!r}", returncode=2)
        if not found.served_model:
            raise CommandError(f"endpoint {found.name!r} has no served model yet: probe it first", returncode=2)
        if json is not None and not json.parent.is_dir():
            raise CommandError(f"--json: the folder {str(json.parent)!r} does not exist", returncode=2)
        from speculation.worker.calibrate import calibrate, format_table

        result = calibrate(endpoint=found, sample=sample, max_tokens=max_tokens)
        self.stdout.write(format_table(result))
        if json is not None:
            json.write_text(_dumps(result) + "\n")
            self.stdout.write(f"written to {json}")


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=2)
