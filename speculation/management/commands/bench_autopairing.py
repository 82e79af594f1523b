"""Auto-pairing vs every single candidate and vs the per-workload oracle, on a mixed workload (no server).

    python manage.py bench_autopairing [--json out.json] [--requests 200] [--max-tokens 48]
        [--target DIR] [--drafts DIR,DIR] [--eagle DIR] [--demo-version V] [--seed 0] [--code-share 0.4]
        [--save-measurements PATH] [--shard I/N] [--from-measurements PATH[,PATH...]] [--no-hybrids]
        [--temperature T [--top-p P]]

Defaults: the demo pair's target (speculation.offline.demo, DEMO_VERSION or ACE_DEMO_VERSION) with every draft of
its version (DemoPair.drafts: the main draft and draft-prose on demo-v3, draft-code from demo-v6 on), the demo
target's EAGLE head when it is built (`--eagle ""`: none), and n-gram lookup; `--demo-version` picks another demo
version (e.g. demo-v7: two drafts and a head). Each draft also runs behind suffix decoding (the hybrid
`suffix+DRAFT`, as shadow's candidates; `--no-hybrids`: not). `--save-measurements` keeps the raw per-request figures;
`--shard I/N` measures only the stream's places I, I + N, ... (N processes share a loaded machine's cores);
`--from-measurements` simulates the selection again on such files (shards merged) without measuring;
`--temperature` samples the answers (seeded) and replays the candidates as shadow replays sampled requests. What it
measures and how: speculation.bench.autopairing.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from speculation.management.commands.calibrate import positive_int


class Command(BaseCommand):
    help = "Simulate auto-pairing on a mixed workload; per workload vs single candidates and the oracle."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", type=Path)
        parser.add_argument("--requests", type=positive_int, default=200)
        parser.add_argument("--max-tokens", type=positive_int, default=48)
        parser.add_argument("--target", help="the target's directory (default: the demo pair's)")
        parser.add_argument("--drafts", help="comma-separated draft directories (default: the demo version's)")
        parser.add_argument("--eagle", help="an EAGLE head for the target (default: the demo head when built)")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--code-share", type=float, default=0.4)
        parser.add_argument("--demo-version", help="the demo version whose models are the defaults")
        parser.add_argument("--save-measurements", type=Path, help="write the raw per-request figures here")
        parser.add_argument("--shard", type=shard, default=(0, 1), help="I/N: measure the stream's places I mod N")
        parser.add_argument(
            "--no-hybrids", action="store_true", help="leave out each draft behind suffix decoding (suffix+DRAFT)"
        )
        parser.add_argument(
            "--from-measurements", type=paths, help="simulate again on --save-measurements files (comma-separated)"
        )
        parser.add_argument(
            "--temperature", type=float, default=0.0, help="sample the answers (default 0: greedy); e.g. 0.7"
        )
        parser.add_argument("--top-p", type=float, default=1.0, help="the sampled answers' top_p (default 1)")

    def handle(self, *args: Any, **options: Any) -> None:
        if options["from_measurements"] is not None:
            from speculation.bench.autopairing import resimulate

            try:
                result = resimulate(options["from_measurements"])
            except ValueError as exc:
                raise CommandError(str(exc), returncode=2) from exc
            return self._write(result, options)
        sampling = None
        if options["temperature"] != 0.0 or options["top_p"] != 1.0:
            from speculation.engine.sampling import SamplingParams

            if not options["temperature"] > 0.0:
                raise CommandError(
                    f"--temperature must be > 0 to sample (0: greedy, without --top-p), got {options['temperature']}",
                    returncode=2,
                )
            try:
                sampling = SamplingParams(temperature=options["temperature"], top_p=options["top_p"])
            except ValueError as exc:
                raise CommandError(f"--temperature / --top-p: {exc}", returncode=2) from exc
        try:
            target, drafts, eagle = _models(options)
        except ValueError as exc:  # an unknown --demo-version
            raise CommandError(str(exc), returncode=2) from exc
        for directory in [target, *drafts, *([eagle] if eagle else [])]:
            if not (Path(directory) / "config.json").is_file():
                raise CommandError(f"no model at {directory!r} (config.json missing)", returncode=2)
        if not 0.0 <= options["code_share"] <= 1.0:
            raise CommandError("--code-share must be in [0, 1]", returncode=2)
        from speculation.bench.autopairing import run

        result = run(
            target_dir=target,
            draft_dirs=drafts,
            eagle_dir=eagle,
            requests=options["requests"],
            max_tokens=options["max_tokens"],
            seed=options["seed"],
            code_share=options["code_share"],
            save_measurements=options["save_measurements"],
            shard=options["shard"],
            hybrids=not options["no_hybrids"],
            sampling=sampling,
        )
        self._write(result, options)

    def _write(self, result: dict[str, Any], options: dict[str, Any]) -> None:
        text = json.dumps(result, indent=2)
        self.stdout.write(text)
        if options["json"]:
            options["json"].write_text(text + "\n")


def shard(value: str) -> tuple[int, int]:
    """ "I/N" with 0 <= I < N."""
    index, _, count = value.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected I/N (e.g. 0/3), got {value!r}") from exc
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < N, got {value!r}")
    return i, n


def paths(value: str) -> list[Path]:
    return [Path(p) for p in value.split(",") if p]


def _models(options: dict[str, Any]) -> tuple[str, list[str], str]:
    """The target, the drafts and the EAGLE head ("" for none): as given, else the demo pair's."""
    if options["target"] is not None and options["drafts"] is not None and options["eagle"] is not None:
        return options["target"], [d for d in options["drafts"].split(",") if d], options["eagle"]
    from speculation.offline.demo import ensure_demo_pair
    from speculation.offline.eagle.demo_head import default_head_dir

    pair = ensure_demo_pair(version=options["demo_version"])
    target = options["target"] if options["target"] is not None else str(pair.target_dir)
    drafts = options["drafts"].split(",") if options["drafts"] is not None else [str(d) for d in pair.drafts.values()]
    head = default_head_dir(pair)
    eagle = (
        options["eagle"] if options["eagle"] is not None else (str(head) if (head / "config.json").is_file() else "")
    )
    return target, [d for d in drafts if d], eagle
