"""The EAGLE training pipeline, free of Django: prompts -> target features -> trained head -> saved directory.

Work files (collected features, the per-epoch checkpoint) live in `<out>/_work/`, so running the same
pipeline again with the same out directory resumes where it stopped. The head itself is written to
`<out>/` (config.json + model.safetensors + the target's tokenizer files), servable by vLLM as an EAGLE head.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from speculation.engine.eagle import EagleConfig, EagleHead, init_weights, make_head, param_count
from speculation.engine.eagle_format import read_config
from speculation.offline.eagle.captured import captured_sets
from speculation.offline.eagle.collect import Sequences, collect, collect_text_windows, load_target, target_weights
from speculation.offline.eagle.prompts import CapturedSequence, read_prompts, split_prompts
from speculation.offline.eagle.settings import PipelineResult, PipelineSettings, Progress, kept_report
from speculation.offline.eagle.train import train_head
from speculation.offline.eagle.warm_start import warm_start_problems

logger = logging.getLogger(__name__)

WORK = "_work"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def _collected(
    model, tokenizer, settings: PipelineSettings, work: Path, progress: Progress, layers: tuple[int, ...]
) -> tuple[Sequences, Sequences]:
    """Collect features once; a restart with the same settings reuses the saved ones."""
    key_file, train_file, test_file = work / "collect.json", work / "train.pt", work / "held_out.pt"
    key = {**settings.collect_key(), "feature_layers": list(layers)}  # the taps the features hold
    if key_file.is_file() and json.loads(key_file.read_text()) == key and train_file.is_file() and test_file.is_file():
        progress.stage("collect", "reusing collected features")
        return Sequences.load(train_file), Sequences.load(test_file)
    prompts = read_prompts(settings.prompts)
    if settings.max_prompts:  # every n-th prompt, so each source and category keeps its share
        step = max(1, len(prompts) // settings.max_prompts)
        prompts = prompts[::step][: settings.max_prompts]
    train_prompts, test_prompts = split_prompts(prompts, held_out=settings.held_out)
    progress.stage("collect", f"{len(train_prompts)} training and {len(test_prompts)} held-out prompts")

    def report(done: int, total: int) -> None:
        progress.stage("collect", f"{done}/{total} prompts")

    options = {"max_prompt_tokens": settings.max_prompt_tokens, "new_tokens": settings.new_tokens,
               "feature_layers": layers, "both_ends": settings.both_ends}  # fmt: skip
    train = collect(model, tokenizer, train_prompts, progress=report, **options)
    test = collect(model, tokenizer, test_prompts, progress=report, **options)
    if settings.text_windows:
        from speculation.offline.demo.corpus import stdlib_corpus

        progress.stage("collect", f"{settings.text_windows} teacher-forced text windows")
        text = stdlib_corpus().train_text(settings.text_windows * settings.window_tokens * 6)
        windows = collect_text_windows(
            model,
            tokenizer,
            text,
            windows=settings.text_windows,
            window_tokens=settings.window_tokens,
            feature_layers=layers,
        )
        train.extend(windows)
    train.save(train_file)
    test.save(test_file)
    key_file.write_text(json.dumps(key))
    return train, test


def _warm_start(settings: PipelineSettings, config: EagleConfig, target_dir: Path) -> tuple[EagleConfig, dict | None]:
    """The config and weights of the head settings.init_from names (warm_start: the run trains it further in its own
    layout), or (config, None) to start from the seeded initialisation. ValueError naming what does not fit."""
    if not settings.init_from:
        return config, None
    problems = warm_start_problems(
        read_config(settings.init_from) or {},
        target=json.loads((target_dir / "config.json").read_text()),
        target_fingerprint=config.target_fingerprint,
        multi_layer=settings.multi_layer,
        intermediate_size=settings.intermediate_size,
    )
    if problems:
        raise ValueError(f"the head in {settings.init_from} cannot start this run: {'; '.join(problems)}")
    start = EagleHead.load(Path(settings.init_from), target_dir=target_dir)  # EagleHeadError: another target
    # this run's target names: a head from elsewhere (no fingerprint) is one trained for this target once saved
    trained_for = {"target_name": config.target_name, "target_fingerprint": config.target_fingerprint}
    return replace(start.config, **trained_for), start.state_dict()


def run_pipeline(
    *,
    target_dir: Path,
    out_dir: Path,
    settings: PipelineSettings,
    target_name: str = "",
    progress: Progress,
    captured: list[CapturedSequence] | None = None,
) -> PipelineResult:
    """Train and save a head; `captured`: an endpoint's captured traffic to train on instead of settings.prompts."""
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    work = out_dir / WORK
    work.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(settings.train.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the same code on a GPU node, unchanged
    progress.stage("load", f"target {target_dir} on {device}")
    model, tokenizer = load_target(target_dir, device)
    embed, lm_head = target_weights(model)
    config = EagleConfig.for_target(
        target_dir,
        target_name=target_name,
        intermediate_size=settings.intermediate_size or None,
        multi_layer=settings.multi_layer,
    )
    config, initial = _warm_start(settings, config, target_dir)  # before collecting: the head's layers are read
    if captured is not None:  # token ids with the target's own outputs: teacher-forced, never written to disk
        train, held_out = captured_sets(
            model, captured, settings=settings, feature_layers=config.feature_layers, progress=progress
        )
    else:
        train, held_out = _collected(model, tokenizer, settings, work, progress, config.feature_layers)
    head = make_head(config)
    if initial is None and config.eagle3:  # EAGLE-3's own final norm starts with the target's scale
        init_weights(head, torch.Generator().manual_seed(settings.train.seed))
        with torch.no_grad():  # the norm of a vector of ones: its scale whatever the family's convention (Gemma 1 + w)
            head.norm.weight.copy_(model.model.norm(torch.ones(1, config.hidden_size, device=embed.device))[0].cpu())
        initial = {name: tensor.clone() for name, tensor in head.state_dict().items()}
    progress.stage("train", f"{param_count(head):,} parameters, {train.total_tokens:,} training tokens"
                   + (f", starting from {settings.init_from}" if settings.init_from else ""))  # fmt: skip
    reports = train_head(head, embed, lm_head, train, held_out, settings.train, work_dir=work,
                         on_epoch=progress.epoch, initial=initial)  # fmt: skip
    progress.stage("save", str(out_dir))
    kept = kept_report(reports)  # the best epoch on held-out acceptance: its weights are the head's
    head.save(
        out_dir,
        extra={
            "trained": {
                "epochs": kept.epochs,
                "seed": settings.train.seed,
                "alpha": kept.alpha,
                "alpha_interval": list(kept.alpha_interval),
                "mean_accepted_len": kept.mean_accepted_len,
                "mean_accepted_len_interval": list(kept.mean_accepted_len_interval),
                "epoch": kept.epoch,
                "eval_k": settings.train.eval_k,
                "unroll": settings.train.unroll,
                "new_tokens": settings.new_tokens,
                "train_tokens": train.total_tokens,
                "prompts": settings.prompts,
                "init_from": settings.init_from,
            }
        },
    )
    for name in TOKENIZER_FILES:
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out_dir / name)
    return PipelineResult(
        head_dir=out_dir,
        reports=reports,
        param_count=param_count(head),
        train_sequences=len(train),
        held_out_sequences=len(held_out),
        train_tokens=train.total_tokens,
    )
