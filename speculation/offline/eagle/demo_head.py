"""The demo target's EAGLE head: where it lives, its proposer when it exists, and building it for any demo version.

Both benchmarks (`python -m speculation.bench` and `python -m speculation.bench.eagle`) use it; neither
imports the other. The head of demo version V is cached in `$ACE_HOME/models/V-eagle`, so switching
`ACE_DEMO_VERSION` (or `DEMO_VERSION`) needs a head for the new target:

    python -m speculation.offline.eagle.demo_head [--version V] [--variant eagle3|eagle1] [--out DIR]

builds it (about 4-8 min on a 2-core CPU) with the launcher's recipe (`ace.demo_drafts.EAGLE_RECIPE`), prints
each epoch's held-out figures and the build time, and writes `build_s` into the head's `ace_eagle.trained`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

from speculation.engine.eagle import CONFIG_FILE, EagleHeadError, EagleProposer, check_target, read_head_config
from speculation.offline.demo.build import ace_home, ensure_demo_pair
from speculation.offline.eagle.settings import (
    MULTI_LAYER_WEIGHTS,
    EpochReport,
    PipelineSettings,
    Progress,
    TrainSettings,
)

logger = logging.getLogger(__name__)

# The launcher's recipe (ace.demo_drafts.EAGLE_RECIPE): Spec-Bench and stdlib prompts continued by the target
# itself (greedy), plus teacher-forced stdlib windows.
EAGLE1 = PipelineSettings(
    prompts="spec_bench,stdlib", max_prompts=96, new_tokens=48, text_windows=256, train=TrainSettings(epochs=4)
)
# EAGLE-3 (vLLM's layout): the target's aux layers, two drafting steps trained (training-time test), and
# EAGLE-3's token-led loss (settings.MULTI_LAYER_WEIGHTS).
EAGLE3 = replace(EAGLE1, multi_layer=True, train=replace(EAGLE1.train, unroll=2, **MULTI_LAYER_WEIGHTS))
# Sized for a target that does not loop (demo-v7): twice the prompts, the bench's 256-token prompt length (a
# summarization or RAG answer copies from a long prompt), 64 new tokens and twice the text windows. From scratch
# it needs about 10 epochs (early stopping, patience 3); with --init-from (the version's eagle3 head, which was
# still improving at its last epoch) 2 more epochs at half the learning rate.
EAGLE3_LONG = replace(
    EAGLE3,
    max_prompts=192,
    max_prompt_tokens=256,
    new_tokens=64,
    text_windows=512,
    train=replace(EAGLE3.train, epochs=10, patience=3),
)
# eagle3-long, and a prompt longer than 256 tokens also gives its first 256 tokens (a document cut where its text
# goes on, as the bench cuts its prompts) besides its last ones.
EAGLE3_ENDS = replace(EAGLE3_LONG, both_ends=True)
# eagle3-long on every prompt of both sources (1,070: 898 training sequences and 172 held out, where the 192 prompts
# gave the MT-Bench categories one training prompt each), 8 epochs: the head that beats the demo draft on demo-v10
# (docs/BENCHMARKS.md, "EAGLE heads"); about 25 min on this 2-core CPU (163 s
# collecting, 8 epochs of 150-180 s).
EAGLE3_ALL = replace(EAGLE3_LONG, max_prompts=0, train=replace(EAGLE3_LONG.train, epochs=8))
# eagle3-all plus the target's continuations of 512 docstring paragraph starts (prompts.DOCSTRINGS): the memorised
# passages the demo target answers with, which its main draft is distilled on.
EAGLE3_PROSE = replace(EAGLE3_ALL, prompts="spec_bench,stdlib,docstrings")
FINE_TUNE = {"epochs": 2, "lr": EAGLE3.train.lr / 2, "patience": 0}
VARIANTS = {"eagle1": EAGLE1, "eagle3": EAGLE3, "eagle3-long": EAGLE3_LONG, "eagle3-ends": EAGLE3_ENDS,
            "eagle3-all": EAGLE3_ALL, "eagle3-prose": EAGLE3_PROSE}  # fmt: skip


def default_head_dir(pair) -> Path:
    return ace_home() / "models" / f"{pair.root.name}-eagle"


def eagle_proposer_for(pair, target_model, head_dir: Path | None = None) -> EagleProposer | None:
    """The demo target's EAGLE proposer when a head for this target is there (None otherwise: no head, or one
    trained for an earlier build of the version, which is logged)."""
    head_dir = head_dir or default_head_dir(pair)
    if not (head_dir / CONFIG_FILE).is_file():
        return None
    if not _fits(head_dir, pair):
        logger.warning("the EAGLE head in %s was trained for another build of %s: not used", head_dir, pair.root.name)
        return None
    return EagleProposer.from_dir(head_dir, target_model, target_dir=pair.target_dir)


def _fits(head_dir: Path, pair) -> bool:
    try:
        check_target(read_head_config(head_dir), pair.target_dir)
    except EagleHeadError:
        return False
    return True


class _Log(Progress):
    def stage(self, name: str, detail: str = "") -> None:
        logger.info("[%s] %s", name, detail)

    def epoch(self, report: EpochReport) -> None:
        logger.info(
            "epoch %d/%d  held-out alpha %.3f [%.3f, %.3f]  mean accepted len %.3f [%.3f, %.3f]  %.0f s",
            report.epoch, report.epochs, report.alpha, *report.alpha_interval, report.mean_accepted_len,
            *report.mean_accepted_len_interval, report.seconds,
        )  # fmt: skip


def build_demo_head(
    pair, *, out: Path | None = None, settings: PipelineSettings = EAGLE3, progress: Progress | None = None
) -> Path:
    """Train the head for the pair's target into out (default: the version's cache directory) unless one is there.

    Written to a temporary directory and renamed, so a reader never sees half a head; the training's work files
    stay in ``<out>.work`` (a restart resumes from them) and go once the head is in place. A head trained for an
    earlier build of the version's target (another fingerprint) is moved aside and a new one trained.
    """
    from speculation.offline.demo.build import _locked
    from speculation.offline.eagle.pipeline import run_pipeline

    out = Path(out or default_head_dir(pair))
    if (out / CONFIG_FILE).is_file() and _fits(out, pair):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f"{out.name}.lock"):
        if (out / CONFIG_FILE).is_file():
            if _fits(out, pair):  # another process built it while we waited
                return out
            stale = out.parent / f".{out.name}.stale-{os.getpid()}"
            logger.info("the head in %s was trained for another build of the target: moved to %s", out, stale)
            out.rename(stale)
        work = out.parent / f"{out.name}.work"
        started = time.perf_counter()
        result = run_pipeline(target_dir=pair.target_dir, out_dir=work, settings=settings,
                              target_name=f"{pair.root.name}/target", progress=progress or _Log())  # fmt: skip
        config = json.loads((work / CONFIG_FILE).read_text())
        config["ace_eagle"]["trained"]["build_s"] = round(time.perf_counter() - started, 1)
        (work / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
        shutil.copytree(work, tmp, ignore=shutil.ignore_patterns("_work"))
        tmp.rename(out)
        shutil.rmtree(work, ignore_errors=True)
    logger.info("EAGLE head for %s in %s (%s parameters)", pair.root.name, out, f"{result.param_count:,}")
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(prog="python -m speculation.offline.eagle.demo_head", description=__doc__)
    parser.add_argument("--version", help="demo pair version (default: DEMO_VERSION)")
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="eagle3")
    parser.add_argument("--out", type=Path, help="head directory (default: $ACE_HOME/models/<version>-eagle)")
    parser.add_argument("--epochs", type=int, help="override the recipe's epochs")
    parser.add_argument("--init-from", type=Path, help="train this saved head (same target) further on the recipe")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)  # the same weights whatever the core count (as the demo pair's build)
    settings = VARIANTS[args.variant]
    if args.init_from:
        settings = replace(settings, init_from=str(args.init_from), train=replace(settings.train, **FINE_TUNE))
    if args.epochs:
        settings = replace(settings, train=replace(settings.train, epochs=args.epochs))
    pair = ensure_demo_pair(version=args.version)
    started = time.perf_counter()
    out = build_demo_head(pair, out=args.out, settings=settings)
    trained = json.loads((out / CONFIG_FILE).read_text())["ace_eagle"].get("trained", {})
    print(f"head {out}: held-out alpha {trained.get('alpha')} {trained.get('alpha_interval')}, mean accepted len "
          f"{trained.get('mean_accepted_len')}; built in {trained.get('build_s')} s "
          f"({time.perf_counter() - started:.0f} s this call)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
