"""EAGLE training settings, reports and progress hooks: plain dataclasses without torch.

The web process validates and stores a training run's settings with these; only the worker that trains imports
`speculation.offline.eagle.train` / `pipeline` (and so torch).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 4
    lr: float = 2e-3
    batch_size: int = 8
    feature_weight: float = 1.0
    token_weight: float = 0.1
    noise: float = 0.1  # uniform noise amplitude on input features, relative to their RMS
    grad_clip: float = 0.5
    warmup_steps: int = 20
    eval_k: int = 5
    seed: int = 0
    # Early stopping on held-out acceptance: stop after this many epochs without a better held-out mean
    # accepted length (0: train every epoch). Either way the head kept is the best epoch's.
    patience: int = 0
    # Training-time test (EAGLE-3): the head also drafts unroll - 1 more steps from its own predicted features,
    # as it does at inference, each step's loss counted (1: teacher-forced inputs only, EAGLE-1).
    unroll: int = 1
    # Loss weight of a position whose next token is prompt text or a teacher-forced text window, relative to one
    # whose next token is the target's own continuation (what the head drafts for at inference). 1: all alike.
    context_weight: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.unroll <= 4:
            raise ValueError(f"unroll must be between 1 and 4, got {self.unroll}")
        if not 0 <= self.context_weight <= 1:
            raise ValueError(f"context_weight must be between 0 and 1, got {self.context_weight}")


# EAGLE-3's token-led loss for a multi-layer head (its recipes and `train_eagle --multi-layer`): the head's output
# is a drafting state, judged by the tokens it drafts, with a light feature regression left as a regulariser.
# On demo-v10 it raised held-out alpha from 0.375 to 0.437 (the `eagle3` recipe) and from 0.663 to 0.715 (the
# `eagle3-long` one): docs/BENCHMARKS.md, "EAGLE heads".
MULTI_LAYER_WEIGHTS = {"token_weight": 1.0, "feature_weight": 0.1}


@dataclass(frozen=True)
class EpochReport:
    epoch: int
    epochs: int
    loss: float
    feature_loss: float
    token_loss: float
    alpha: float
    mean_accepted_len: float
    acceptance_rate: float
    seconds: float
    categories: dict
    # 95 % bootstrap intervals over the held-out sequences (evaluate.bootstrap_interval)
    alpha_interval: tuple[float, float] = (0.0, 0.0)
    mean_accepted_len_interval: tuple[float, float] = (0.0, 0.0)
    best_epoch: int = 0  # the epoch whose weights are kept so far (best held-out mean accepted length)

    def as_dict(self) -> dict:
        out = asdict(self)
        for key in ("loss", "feature_loss", "token_loss", "seconds"):
            out[key] = round(out[key], 5)
        return out


@dataclass(frozen=True)
class PipelineSettings:
    prompts: str = "spec_bench"
    max_prompts: int = 0  # 0: all
    held_out: float = 0.15
    max_prompt_tokens: int = 64
    # a prompt longer than max_prompt_tokens gives its first tokens as a second sequence (collect.collect)
    both_ends: bool = False
    new_tokens: int = 64
    intermediate_size: int = 0  # 0: the target's
    # Teacher-forced windows of the demo corpus' training text (stdlib sources), added to the training set.
    text_windows: int = 0
    window_tokens: int = 128
    # an EAGLE-3 head (engine/eagle3.py): it reads the target's aux layers vLLM picks by default
    multi_layer: bool = False
    # A saved head for the same target to start from (more training steps for a head that was still improving,
    # on new data); "" starts from the seeded initialisation.
    init_from: str = ""
    train: TrainSettings = field(default_factory=TrainSettings)

    def collect_key(self) -> dict:
        keys = (
            "prompts",
            "max_prompts",
            "held_out",
            "max_prompt_tokens",
            "both_ends",
            "new_tokens",
            "text_windows",
            "window_tokens",
            "multi_layer",
        )
        return {**{k: getattr(self, k) for k in keys}, "seed": self.train.seed}

    @classmethod
    def from_dict(cls, data: dict) -> PipelineSettings:
        data = dict(data)
        train = TrainSettings(**data.pop("train", {}))
        return cls(train=train, **data)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class PipelineResult:
    head_dir: Path
    reports: list[EpochReport]
    param_count: int
    train_sequences: int
    held_out_sequences: int
    train_tokens: int

    @property
    def kept(self) -> EpochReport:
        return kept_report(self.reports)


def kept_report(reports: list[EpochReport]) -> EpochReport:
    """The report of the epoch whose weights were saved (the best on held-out acceptance)."""
    best = reports[-1].best_epoch or reports[-1].epoch
    return next(r for r in reports if r.epoch == best)


class Progress:
    """Callbacks the pipeline reports through (the CLI prints, the Celery task writes the TrainingRun row)."""

    def stage(self, name: str, detail: str = "") -> None:  # noqa: B027 - optional hook
        pass

    def epoch(self, report: EpochReport) -> None:  # noqa: B027 - optional hook
        pass


def default_target_name(target_dir: Path) -> str:
    """The directory's last two parts ("demo-v3/target"): model directories are often just "target"."""
    path = Path(target_dir).resolve()
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name
