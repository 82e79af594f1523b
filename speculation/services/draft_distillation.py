"""Draft distillation on an endpoint's captured traffic as a training run (TrainingRun.kind draft_model).

A registered draft model (or a draft directory under the model roots) is fine-tuned on the served outputs of
`captured:<endpoint>[:<workload>]` (speculation.offline.distill), by the endpoint team's admins only, exactly as an
EAGLE run on captures (speculation.services.eagle_training: same source check, team, held-out split, progress row,
Celery task and held-out replay). The draft must speak the endpoint's tokenizer: a probed tokenizer fingerprint or
the policy's local target (`target_path`) that differs in fingerprint or vocabulary size is refused, naming it. The
distilled draft is registered as a draft model of the endpoint's team, so it joins its auto-pairing candidates.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ValidationError
from django.utils import timezone
from django.utils.text import slugify

from fleet.models import Endpoint
from speculation.engine.eagle_format import is_head_config
from speculation.jobs import queue
from speculation.models import DraftKind, DraftModel, TrainingKind, TrainingRun, TrainingStatus
from speculation.offline.eagle.prompts import captured_source
from speculation.offline.eagle.settings import PipelineSettings, Progress, TrainSettings
from speculation.selectors.capabilities import tokenizer_fingerprint
from speculation.selectors.drafts import visible_drafts
from speculation.services import model_files
from speculation.services.drafts import register_draft
from speculation.services.eagle_training import (
    _check_bounds,
    _checked_captured,
    _prove_on_held_out,
    _RowProgress,
    captured_sequences,
)

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, Group

logger = logging.getLogger(__name__)

# A draft is a trained language model: fine-tuned gently (a head starts at 2e-3), unless options set lr.
DISTILL_LR = 1e-4
OPTIONS = ("max_prompts", "held_out", "max_prompt_tokens", "new_tokens")
TRAIN_OPTIONS = ("lr", "batch_size", "warmup_steps", "grad_clip", "eval_k", "patience")


def _checked_draft(draft: str, *, user: AbstractBaseUser | None) -> tuple[model_files.ModelFacts, DraftModel | None]:
    """The draft model to continue from: a registered draft model the user may see (None, the CLI: any) or a draft
    directory under the model roots."""
    if not draft:
        raise ValidationError({"init_from": ["name the draft model to distil (its registered name or directory)"]})
    drafts = visible_drafts(user) if user is not None else DraftModel.objects.all()
    registered = drafts.filter(name=draft, kind=DraftKind.DRAFT_MODEL).first()
    try:
        facts = model_files.inspect_model_dir(registered.path if registered else draft, field="init_from", llama=True)
    except ValidationError as exc:
        if registered is not None:
            raise
        raise ValidationError({"init_from": [
            f"{draft}: neither a registered draft model you may use nor a draft directory under the model roots"
        ]}) from exc  # fmt: skip
    if is_head_config(facts.config):
        raise ValidationError({"init_from": [f"{draft} is an EAGLE head: distil a draft model"]})
    return facts, registered


def _check_vocabulary(draft: model_files.ModelFacts, prompts: str) -> None:
    """Refuse a draft whose tokenizer is not the endpoints' (probed fingerprint, or the policy's local target)."""
    for part in prompts.split(","):
        endpoint = Endpoint.objects.select_related("policy").get(pk=int(captured_source(part)[0]))
        probed = tokenizer_fingerprint(endpoint)
        if probed and draft.tokenizer_fingerprint and probed != draft.tokenizer_fingerprint:
            raise ValidationError({"init_from": [
                f"the draft's tokenizer is not endpoint {endpoint.name}'s (fingerprint {draft.tokenizer_fingerprint}"
                f" against {probed}): distil a draft of its model's family"
            ]})  # fmt: skip
        policy = getattr(endpoint, "policy", None)
        if policy is None or not policy.target_path:
            continue
        target = model_files.inspect_model_dir(policy.target_path, field="init_from", llama=True)
        ours, theirs = draft.config.get("vocab_size"), target.config.get("vocab_size")
        if ours != theirs or draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
            raise ValidationError({"init_from": [
                f"the draft's vocabulary ({ours} tokens, tokenizer {draft.tokenizer_fingerprint}) is not endpoint "
                f"{endpoint.name}'s target's ({theirs} tokens, tokenizer {target.tokenizer_fingerprint})"
            ]})  # fmt: skip


def create_distillation_run(
    *,
    draft: str,
    out_dir: str,
    prompts: str,
    name: str = "",
    epochs: int = 4,
    seed: int = 0,
    node_class: str = "cpu",
    options: dict[str, Any] | None = None,
    owner: AbstractBaseUser | None = None,
    team: Group | None = None,
) -> TrainingRun:
    """Validate and record a draft distillation run (queued). draft: a registered draft model's name or a draft
    directory under the model roots; prompts: captured sources only; options: OPTIONS and TRAIN_OPTIONS."""
    facts, registered = _checked_draft(draft, user=owner)
    out = model_files.under_roots(out_dir, field="out_dir")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValidationError({"out_dir": [f"{out} exists and is not an empty directory"]})
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS) - set(TRAIN_OPTIONS))
    if unknown:
        raise ValidationError({"options": [f"not a draft distillation setting: {', '.join(unknown)}"]})
    _check_bounds(epochs=epochs, seed=seed, options=options)
    parts = [part for part in (prompts or "").split(",") if part.strip()]
    if not parts or not all(captured_source(part) for part in parts):
        raise ValidationError({"prompts": ["a draft distils an endpoint's captured traffic: captured:<endpoint>"]})
    prompts, team = _checked_captured(prompts, user=owner, target_fingerprint="", team=team)
    _check_vocabulary(facts, prompts)
    train = {"lr": DISTILL_LR, **{k: options.pop(k) for k in TRAIN_OPTIONS if k in options}}
    try:
        settings = PipelineSettings(prompts=prompts, init_from=str(facts.directory), **options,
                                    train=TrainSettings(**train, epochs=epochs, seed=seed))  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise ValidationError({"options": [str(exc)]}) from exc
    source = registered.name if registered else facts.directory.name
    run = TrainingRun(
        kind=TrainingKind.DRAFT_MODEL,
        name=(name or slugify(f"distilled-{source}-s{seed}"))[:64],
        target_dir=str(facts.directory),
        target_name=registered.target_name if registered else "",
        out_dir=str(out),
        prompts=prompts,
        node_class=node_class,
        seed=seed,
        epochs=epochs,
        config=settings.as_dict(),
        owner=owner if owner is not None and owner.is_authenticated else None,
        team=team,
    )
    run.full_clean()
    run.save()
    return run


def start_distillation_run(**kwargs: Any) -> TrainingRun:
    """Create a run and queue it on the node class's GPU queue once the row is committed (the training task)."""
    run = create_distillation_run(**kwargs)
    queue.enqueue_training_on_commit(run)
    return run


def run_distillation(*, run: TrainingRun, echo: Progress | None = None, register: bool = True) -> TrainingRun:
    """Run a distillation run in this process (again from the draft after a crash); registers the distilled draft."""
    if run.status == TrainingStatus.DONE:
        return run
    run.status, run.error, run.started_at = TrainingStatus.RUNNING, "", run.started_at or timezone.now()
    run.save(update_fields=["status", "error", "started_at", "updated_at"])
    from speculation.offline.distill import distill_on_captures  # torch: imported by the worker only

    settings = PipelineSettings.from_dict(run.config)
    try:
        captured = captured_sequences(settings) or []
        result = distill_on_captures(draft_dir=Path(run.target_dir), out_dir=Path(run.out_dir), sequences=captured,
                                     settings=settings, progress=_RowProgress(run, echo))  # fmt: skip
        draft = register_distilled(run=run, result=result) if register else None
    except BaseException as exc:
        run.status, run.error, run.finished_at = TrainingStatus.FAILED, f"{type(exc).__name__}: {exc}", timezone.now()
        run.save(update_fields=["status", "error", "finished_at", "updated_at"])
        logger.warning("distillation run %s failed: %s", run.pk, run.error)
        raise
    run.status, run.stage, run.draft, run.finished_at = TrainingStatus.DONE, "done", draft, timezone.now()
    run.alpha, run.mean_accepted_len = result.kept.alpha, result.kept.mean_accepted_len
    run.save(update_fields=["status", "stage", "draft", "alpha", "mean_accepted_len", "finished_at", "updated_at"])
    if draft is not None:
        _prove_on_held_out(captured, settings)
    return run


def register_distilled(*, run: TrainingRun, result) -> DraftModel:
    """Register the distilled draft as a draft model of the run's team, with what it was trained on."""
    name = run.name
    if DraftModel.objects.filter(name__iexact=name).exists():
        name = f"{run.name[:54]}-run{run.pk}"
    draft = register_draft(name=name, kind=DraftKind.DRAFT_MODEL, path=str(result.draft_dir),
                           node_class=run.node_class, target_name=run.target_name, owner=run.owner,
                           team=run.team)  # fmt: skip
    kept = result.kept
    draft.config = {
        **draft.config,
        "distillation": {
            "training_run": run.pk,
            "captured": run.prompts,
            "continued_from": run.target_dir,
            "epoch": kept.epoch,
            "alpha": kept.alpha,
            "mean_accepted_len": kept.mean_accepted_len,
            "original_alpha": result.original.alpha,
            "original_mean_accepted_len": result.original.mean_accepted_len,
            "eval_k": PipelineSettings.from_dict(run.config).train.eval_k,
            "train_tokens": result.train_tokens,
        },
    }
    draft.save(update_fields=["config"])
    return draft
