"""EAGLE head training as a service: a TrainingRun row records inputs and progress; the run registers its head.

`start_training_run` creates the row and queues the Celery task on the node class's GPU queue (on commit);
`run_training` executes a run in this process (the task and the management command both call it). A run
that crashed resumes from its last epoch checkpoint when run again (same out directory). A run's prompts are named
sources, files under the model roots, or an endpoint's captured traffic (`captured:<endpoint>[:<workload>]`, for its
team's admins: its served outputs are the training sequences, speculation.offline.eagle.captured).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.core.exceptions import PermissionDenied, ValidationError
from django.http import Http404
from django.utils import timezone
from django.utils.text import slugify

from fleet.models import Endpoint
from fleet.permissions import check_captures
from speculation.engine.eagle_format import read_config, target_fingerprint
from speculation.jobs import queue
from speculation.models import CapturedRequest, DraftKind, DraftModel, TrainingRun, TrainingStatus
from speculation.offline.eagle.prompts import (
    CAPTURED,
    DOCSTRINGS,
    SPEC_BENCH,
    STDLIB,
    CapturedSequence,
    captured_source,
    split_prompts,
)
from speculation.offline.eagle.settings import (
    EpochReport,
    PipelineResult,
    PipelineSettings,
    Progress,
    TrainSettings,
    default_target_name,
)
from speculation.offline.eagle.warm_start import WARM_START_LR, warm_start_problems
from speculation.selectors.capabilities import tokenizer_fingerprint
from speculation.selectors.captures import sequences
from speculation.selectors.drafts import visible_drafts
from speculation.services import model_files
from speculation.services.drafts import register_draft

if TYPE_CHECKING:
    from django.contrib.auth.models import AbstractBaseUser, Group

logger = logging.getLogger(__name__)

# A run's bounds: far above the demo recipes (4-8 epochs), low enough that no request books a GPU for months.
MAX_EPOCHS = 100
MAX_SEED = 2**31 - 1  # the database column's range
# A prompt file is read whole by the worker: 64 MiB is some 100,000 long prompts.
PROMPTS_MAX_BYTES = 64 * 1024 * 1024
NAMED_PROMPT_SOURCES = (SPEC_BENCH, STDLIB, DOCSTRINGS)
MIN_CAPTURED = 8  # captured requests a run needs: some to train on, some (the oldest of each workload) held out
# CLI options (PipelineSettings / TrainSettings fields) that size the work: (minimum, maximum).
OPTION_BOUNDS = {
    "max_prompts": (0, 1_000_000),
    "new_tokens": (1, 4096),
    "max_prompt_tokens": (1, 8192),
    "text_windows": (0, 1_000_000),
    "window_tokens": (1, 8192),
    "intermediate_size": (0, 2**20),
    "batch_size": (1, 4096),
    "patience": (0, MAX_EPOCHS),
}


def _checked_prompts(prompts: str) -> str:
    """The prompt sources, each a named one or a file under the model roots (at most PROMPTS_MAX_BYTES).

    A path outside the roots gets one message whether or not it exists: the run's error must not tell a caller
    what the server's file system holds.
    """
    parts = [part.strip() for part in (prompts or SPEC_BENCH).split(",")]
    outside = ValidationError(
        {
            "prompts": [
                f"each prompt source must be one of {', '.join(NAMED_PROMPT_SOURCES)} or a file under the model "
                "roots (ACE_MODEL_ROOTS)"
            ]
        }
    )
    checked = []
    for part in parts:
        if part in NAMED_PROMPT_SOURCES:
            checked.append(part)
            continue
        try:
            path = model_files.under_roots(part, field="prompts")
        except ValidationError as exc:
            raise outside from exc
        if not path.is_file():
            raise ValidationError({"prompts": [f"{path} is not a file"]})
        size = path.stat().st_size
        if size > PROMPTS_MAX_BYTES:
            raise ValidationError({"prompts": [f"{path} holds {size} bytes: at most {PROMPTS_MAX_BYTES}"]})
        checked.append(str(path))
    return ",".join(checked)


def _checked_captured(
    prompts: str, *, user: AbstractBaseUser | None, target_fingerprint: str, team: Group | None
) -> tuple[str, Group | None]:
    """`captured:<endpoint name or id>[:<workload>]` sources, as `captured:<id>[:<workload>]`, and the run's team:
    endpoints whose captured traffic the user may use (its team's admins: fleet.permissions.check_captures; None,
    the CLI: any), with the target's tokenizer, holding at least MIN_CAPTURED requests. One message for an endpoint
    that does not exist and one the user may not use: the error must not tell another team what exists.

    A head learns its training data: the run and its head belong to the endpoints' team (so the head is one of
    their auto-pairing candidates, speculation.selectors.drafts.drafts_usable_by), never to another team."""
    checked, teams = [], set()
    for part in prompts.split(","):
        source = captured_source(part)
        if source is None:
            raise ValidationError({"prompts": ["captured traffic is not mixed with other prompt sources"]})
        name, workload = source
        endpoint = Endpoint.objects.filter(**({"pk": int(name)} if name.isdigit() else {"name": name})).first()
        try:
            if endpoint is None:
                raise Http404
            if user is not None:
                check_captures(user, endpoint)
        except (Http404, PermissionDenied) as exc:
            raise ValidationError(
                {"prompts": [f"{part.strip()}: no endpoint whose captured traffic you may use (its team's admins)"]}
            ) from exc
        endpoint_fingerprint = tokenizer_fingerprint(endpoint)
        if endpoint_fingerprint and target_fingerprint and endpoint_fingerprint != target_fingerprint:
            raise ValidationError(
                {"prompts": [f"{part.strip()}: the endpoint's tokenizer is not target_dir's: train for its own model"]}
            )
        rows = CapturedRequest.objects.filter(endpoint=endpoint, **({"workload": workload} if workload else {}))
        count = rows.count()
        if count < MIN_CAPTURED:
            raise ValidationError(
                {"prompts": [f"{part.strip()}: {count} captured requests; a run needs at least {MIN_CAPTURED}"]}
            )
        checked.append(f"{CAPTURED}:{endpoint.pk}" + (f":{workload}" if workload else ""))
        teams.add(endpoint.team)
    if len(teams) > 1:
        raise ValidationError({"prompts": ["captured traffic of one team's endpoints at a time"]})
    own = teams.pop()
    if team is not None and team != own:
        raise ValidationError({"team": ["a run on captured traffic belongs to its endpoint's team"]})
    return ",".join(checked), own


def _checked_init_from(
    init_from: str,
    *,
    user: AbstractBaseUser | None,
    target: model_files.ModelFacts,
    multi_layer: bool,
    intermediate_size: int,
) -> str:
    """The directory of the head a run continues from: a registered EAGLE head the user may see (None, the CLI: any)
    or a directory under the model roots; ValidationError naming what does not fit the run (warm_start_problems)."""
    draft = visible_drafts(user) if user is not None else DraftModel.objects.all()
    draft = draft.filter(name=init_from, kind=DraftKind.EAGLE_HEAD).first()
    if draft is not None:
        directory = Path(draft.path)
    else:
        try:
            directory = model_files.under_roots(init_from, field="init_from")
        except ValidationError as exc:
            raise ValidationError({"init_from": [
                f"{init_from}: neither a registered EAGLE head you may use nor a directory under the model roots"
            ]}) from exc  # fmt: skip
    head = read_config(directory)
    if head is None:
        raise ValidationError({"init_from": [f"{init_from}: no readable config.json in {directory}"]})
    problems = warm_start_problems(head, target=target.config, target_fingerprint=target_fingerprint(target.directory),
                                   multi_layer=multi_layer, intermediate_size=intermediate_size)  # fmt: skip
    if problems:
        raise ValidationError({"init_from": [f"{init_from} cannot start this run: {'; '.join(problems)}"]})
    return str(directory.resolve())


def current_head(endpoint: Endpoint) -> DraftModel | None:
    """The EAGLE head the endpoint's policy drafts with now, or None (another mechanism, or no policy)."""
    policy = getattr(endpoint, "policy", None)
    draft = policy.draft if policy is not None else None
    return draft if draft is not None and draft.kind == DraftKind.EAGLE_HEAD else None


def captured_sequences(settings: PipelineSettings) -> list[CapturedSequence] | None:
    """The decrypted sequences of a run's captured sources (the newest max_prompts of each when set), or None when
    it trains on text prompts. Read in the worker, held in memory only."""
    sources = [captured_source(part) for part in settings.prompts.split(",")]
    if not all(sources):
        return None
    out: list[CapturedSequence] = []
    for endpoint, workload in sources:
        out += sequences(endpoint_id=int(endpoint), workload=workload, limit=settings.max_prompts)
    return out


def _check_bounds(*, epochs: int, seed: int, options: dict[str, Any]) -> None:
    bounds = {"epochs": (1, MAX_EPOCHS), "seed": (0, MAX_SEED), **OPTION_BOUNDS}
    values = {"epochs": epochs, "seed": seed, **options}
    errors = {}
    for name, value in values.items():
        if name not in bounds:
            continue
        low, high = bounds[name]
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            errors[name] = [f"must be an integer from {low} to {high}"]
    if errors:
        raise ValidationError(errors)


def create_training_run(
    *,
    target_dir: str,
    out_dir: str,
    name: str = "",
    target_name: str = "",
    prompts: str = "spec_bench",
    epochs: int = 4,
    seed: int = 0,
    node_class: str = "cpu",
    options: dict[str, Any] | None = None,
    owner: AbstractBaseUser | None = None,
    team: Group | None = None,
    init_from: str = "",
) -> TrainingRun:
    """Validate and record a training run (queued). options: PipelineSettings / TrainSettings fields.

    init_from: a registered EAGLE head's name or a head directory under the model roots to continue training from
    (warm start, speculation.offline.eagle.warm_start; at WARM_START_LR unless options set lr).

    `owner` and `team` decide who sees the run and the head it registers (fleet.permissions); neither: admins only.
    """
    # Both under the model roots: the worker reads the target and writes (then reloads) its work files there.
    target = model_files.inspect_model_dir(target_dir, field="target_dir", llama=True)
    target_dir = str(target.directory)
    out_dir = str(model_files.under_roots(out_dir, field="out_dir"))
    if Path(out_dir).exists() and not Path(out_dir).is_dir():
        raise ValidationError({"out_dir": [f"{out_dir} exists and is not a directory"]})
    options = dict(options or {})
    _check_bounds(epochs=epochs, seed=seed, options=options)
    if any(captured_source(part) for part in (prompts or "").split(",")):
        prompts, team = _checked_captured(
            prompts, user=owner, target_fingerprint=target.tokenizer_fingerprint, team=team
        )
    else:
        prompts = _checked_prompts(prompts)
    init_from = init_from or options.pop("init_from", "")
    options.pop("init_from", None)
    if init_from:
        options["init_from"] = _checked_init_from(
            str(init_from), user=owner, target=target, multi_layer=bool(options.get("multi_layer")),
            intermediate_size=options.get("intermediate_size") or 0,
        )  # fmt: skip
        options.setdefault("lr", WARM_START_LR)
    train_fields = set(TrainSettings.__dataclass_fields__)
    train = {k: options.pop(k) for k in list(options) if k in train_fields}
    patience = train.get("patience", 0)
    if not isinstance(patience, int) or isinstance(patience, bool) or patience < 0:
        raise ValidationError({"patience": ["must be an integer >= 0 (0: no early stopping)"]})
    try:
        settings = PipelineSettings(prompts=prompts, train=TrainSettings(**{**train, "epochs": epochs, "seed": seed}),
                                    **options)  # fmt: skip
    except (TypeError, ValueError) as exc:  # an unknown option, or a value out of range (unroll, context_weight)
        raise ValidationError({"options": [str(exc)]}) from exc
    default_name = default_target_name(target_dir)
    name = name or slugify(f"eagle-{default_name.replace('/', '-')}-s{seed}")
    run = TrainingRun(
        name=name[:64],
        target_dir=str(Path(target_dir).resolve()),
        target_name=target_name or default_name,
        out_dir=str(Path(out_dir).resolve()),
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


def start_training_run(**kwargs: Any) -> TrainingRun:
    """Create a run and queue it on the node class's GPU queue once the row is committed."""
    run = create_training_run(**kwargs)
    queue.enqueue_training_on_commit(run)
    return run


class _RowProgress(Progress):
    """Writes progress onto the TrainingRun row (the dashboard polls it) and forwards to an optional echo."""

    def __init__(self, run: TrainingRun, echo: Progress | None) -> None:
        self.run = run
        self.echo = echo

    def stage(self, name: str, detail: str = "") -> None:
        self.run.stage = name
        self.run.save(update_fields=["stage", "updated_at"])
        if self.echo:
            self.echo.stage(name, detail)

    def epoch(self, report: EpochReport) -> None:
        run = self.run
        run.epoch = report.epoch
        run.loss = report.loss
        run.alpha = report.alpha
        run.mean_accepted_len = report.mean_accepted_len
        run.log = [e for e in run.log if e["epoch"] < report.epoch] + [report.as_dict()]
        run.save(update_fields=["epoch", "loss", "alpha", "mean_accepted_len", "log", "updated_at"])
        if self.echo:
            self.echo.epoch(report)


def run_training(*, run: TrainingRun, echo: Progress | None = None, register: bool = True) -> TrainingRun:
    """Run (or resume) an EAGLE training run in this process; registers the head as a DraftModel when done (every
    kind of run: speculation.services.training_runs)."""
    if run.status == TrainingStatus.DONE:
        return run
    run.status = TrainingStatus.RUNNING
    run.error = ""
    run.started_at = run.started_at or timezone.now()
    run.save(update_fields=["status", "error", "started_at", "updated_at"])
    from speculation.offline.eagle.pipeline import run_pipeline  # torch: imported by the worker only

    try:
        settings = PipelineSettings.from_dict(run.config)
        captured = captured_sequences(settings)
        result = run_pipeline(
            target_dir=Path(run.target_dir),
            out_dir=Path(run.out_dir),
            settings=settings,
            target_name=run.target_name,
            progress=_RowProgress(run, echo),
            captured=captured,
        )
        draft = register_eagle_head(run=run, result=result) if register else None
    except BaseException as exc:
        run.status = TrainingStatus.FAILED
        run.error = f"{type(exc).__name__}: {exc}"
        run.finished_at = timezone.now()
        run.save(update_fields=["status", "error", "finished_at", "updated_at"])
        logger.warning("training run %s failed: %s", run.pk, run.error)
        raise
    run.status = TrainingStatus.DONE
    run.stage = "done"
    run.draft = draft
    run.alpha, run.mean_accepted_len = result.kept.alpha, result.kept.mean_accepted_len  # the saved epoch's
    run.finished_at = timezone.now()
    run.save(update_fields=["status", "stage", "draft", "alpha", "mean_accepted_len", "finished_at", "updated_at"])
    if captured and draft is not None:
        _prove_on_held_out(captured, settings)
    return run


def _prove_on_held_out(captured: list[CapturedSequence], settings: PipelineSettings) -> None:
    """The new head replayed with every candidate on the captures the run held out (speculation.services.
    capture_replay); a failure there is logged, never the run's."""
    from speculation.services.capture_replay import replay_held_out

    try:
        replay_held_out(split_prompts(captured, held_out=settings.held_out)[1])
    except Exception:  # noqa: BLE001 - the head is trained and registered; live shadow traffic measures it too
        logger.exception("held-out captures not replayed")


def register_eagle_head(*, run: TrainingRun, result: PipelineResult) -> DraftModel:
    """Register the trained head as a DraftModel of kind eagle_head through the draft registry service."""
    name = run.name
    if DraftModel.objects.filter(name__iexact=name).exists():
        name = f"{run.name[:54]}-run{run.pk}"
    draft = register_draft(
        name=name,
        kind=DraftKind.EAGLE_HEAD,
        path=str(result.head_dir),
        node_class=run.node_class,
        target_name=run.target_name,
        owner=run.owner,
        team=run.team,
    )
    last = result.kept  # the epoch whose weights were saved (best held-out acceptance)
    draft.config = {
        **draft.config,
        "eagle": {
            "training_run": run.pk,
            "target_dir": run.target_dir,
            "alpha": last.alpha,
            "alpha_interval": list(last.alpha_interval),
            "mean_accepted_len": last.mean_accepted_len,
            "mean_accepted_len_interval": list(last.mean_accepted_len_interval),
            "eval_k": PipelineSettings.from_dict(run.config).train.eval_k,
            "train_tokens": result.train_tokens,
        },
    }
    draft.save(update_fields=["config"])
    return draft
