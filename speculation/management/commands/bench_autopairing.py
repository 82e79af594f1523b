"""Auto-pairing vs every single candidate and vs the per-workload oracle, on a mixed workload (no server).

    python manage.py bench_autopairing [--json out.json] [--requests 200] [--max-tokens 48]
        [--target DIR] [--drafts DIR,DIR] [--seed 0] [--code-share 0.4]

Defaults: the demo-v5 target with the demo-v5 and demo-v4 drafts (same tokenizer, trained differently) and n-gram
lookup. What it measures and how: speculation.bench.autopairing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from speculation.management.commands.calibrate import positive_int


class Command(BaseCommand):
    help = "Simulate auto-pairing on a mixed workload; per workload vs single candidates and the oracle."

    def add_arguments(self, parser) -> None:
        models = Path(settings.ACE_HOME) / "models"
        parser.add_argument("--json", type=Path)
        parser.add_argument("--requests", type=positive_int, default=200)
        parser.add_argument("--max-tokens", type=positive_int, default=48)
        parser.add_argument("--target", default=str(models / "demo-v5" / "target"))
        parser.add_argument("--drafts", default=f"{models / 'demo-v5' / 'draft'},{models / 'demo-v4' / 'draft'}")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--code-share", type=float, default=0.4)

    def handle(self, *args: Any, **options: Any) -> None:
        drafts = [d for d in options["drafts"].split(",") if d]
        for directory in [options["target"], *drafts]:
            if not (Path(directory) / "config.json").is_file():
                raise CommandError(f"no model at {directory!r} (config.json missing)", returncode=2)
        if not 0.0 <= options["code_share"] <= 1.0:
            raise CommandError("--code-share must be in [0, 1]", returncode=2)
        from speculation.bench.autopairing import run

        result = run(
            target_dir=options["target"],
            draft_dirs=drafts,
            requests=options["requests"],
            max_tokens=options["max_tokens"],
            seed=options["seed"],
            code_share=options["code_share"],
        )
        text = json.dumps(result, indent=2)
        self.stdout.write(text)
        if options["json"]:
            options["json"].write_text(text + "\n")
