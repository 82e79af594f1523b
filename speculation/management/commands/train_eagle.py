"""Train an EAGLE head for a target and register it as a draft:

    python manage.py train_eagle --target DIR --out DIR [--prompts spec_bench|FILE|captured:ENDPOINT[:WORKLOAD]]
        [--epochs N] [--seed S]
        [--multi-layer] [--unroll N] [--init-from HEAD]

Prints progress (stages, then one line per epoch: loss, held-out alpha and mean accepted length). Running
the same command again after a crash resumes the run recorded for that out directory from its last epoch.
`--queue` hands the run to the node class's GPU worker instead of training in this process.
"""

from __future__ import annotations

import torch
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from speculation.management.commands._echo import CommandEcho
from speculation.models import TrainingRun, TrainingStatus
from speculation.offline.eagle.settings import MULTI_LAYER_WEIGHTS
from speculation.offline.eagle.train import EpochReport
from speculation.services.eagle_training import create_training_run, run_training, start_training_run


class _Echo(CommandEcho):
    def line(self, report: EpochReport) -> str:
        return (
            f"epoch {report.epoch}/{report.epochs}  loss {report.loss:.4f} (feature {report.feature_loss:.4f}, "
            f"token {report.token_loss:.4f})  held-out alpha {report.alpha:.3f} "
            f"[{report.alpha_interval[0]:.3f}, {report.alpha_interval[1]:.3f}]  "
            f"mean accepted len {report.mean_accepted_len:.3f} "
            f"[{report.mean_accepted_len_interval[0]:.3f}, {report.mean_accepted_len_interval[1]:.3f}]  "
            f"best epoch {report.best_epoch}  {report.seconds:.0f}s"
        )


class Command(BaseCommand):
    help = "Train an EAGLE head on a target's features and register it as a draft (kind eagle_head)."

    def add_arguments(self, parser) -> None:
        parser.add_argument(
            "--target", required=True, help="the target's Hugging Face checkpoint (any family the engine runs)"
        )
        parser.add_argument(
            "--out", required=True, help="where the head (and its _work/ checkpoint) goes: under ACE_MODEL_ROOTS"
        )
        parser.add_argument(
            "--prompts",
            default="spec_bench",
            help="spec_bench (default), stdlib, docstrings, a .jsonl/.txt file, or several joined by commas; or an "
            "endpoint's captured traffic, captured:ENDPOINT[:WORKLOAD] (not mixed with the others)",
        )
        parser.add_argument("--epochs", type=int, default=4)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--name", default="", help="draft name (default eagle-<target>-s<seed>)")
        parser.add_argument("--target-name", default="", help="the target's name (default: its directory name)")
        parser.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts (0: all)")
        parser.add_argument("--new-tokens", type=int, default=64, help="target tokens generated per prompt")
        parser.add_argument(
            "--max-prompt-tokens", type=int, default=64, help="a longer prompt keeps its last N tokens (default 64)"
        )
        parser.add_argument(
            "--text-windows", type=int, default=0, help="add N teacher-forced windows of stdlib text to training"
        )
        parser.add_argument("--lr", type=float, default=None)
        parser.add_argument(
            "--patience", type=int, default=0,
            help="stop after N epochs without a better held-out mean accepted length (0: off); the best epoch is kept",
        )  # fmt: skip
        parser.add_argument(
            "--token-weight", type=float, default=None,
            help="weight of the token loss (default 0.1, EAGLE-1's; --multi-layer: 1.0, EAGLE-3's token-led loss)",
        )  # fmt: skip
        parser.add_argument(
            "--feature-weight", type=float, default=None,
            help="weight of the feature regression loss (default 1.0; --multi-layer: 0.1)",
        )  # fmt: skip
        parser.add_argument(
            "--context-weight", type=float, default=None,
            help="loss weight (0-1) of positions whose next token is prompt text or a text window, against the "
            "target's own continuation (default 1: all alike)",
        )  # fmt: skip
        parser.add_argument("--intermediate-size", type=int, default=0, help="the head's MLP width (0: target's)")
        parser.add_argument(
            "--multi-layer", action="store_true",
            help="an EAGLE-3 head in vLLM's layout (the target's layers vLLM picks; vLLM eagle3, SGLang EAGLE3)",
        )  # fmt: skip
        parser.add_argument(
            "--unroll", type=int, default=1,
            help="training-time test: drafting steps trained from the head's own predictions (1-4; 1: EAGLE-1)",
        )  # fmt: skip
        parser.add_argument(
            "--init-from", default="",
            help="continue training this head (a registered EAGLE head's name or its directory): same target and kind "
            "of head (--multi-layer for a multi-layer one); default learning rate a quarter of a new head's",
        )  # fmt: skip
        parser.add_argument(
            "--threads", type=int, default=1, help="torch CPU threads (default 1: best on a shared CPU; 0: torch's)"
        )
        parser.add_argument("--node-class", default="cpu")
        parser.add_argument("--no-register", action="store_true", help="train only; register no draft")
        parser.add_argument("--queue", action="store_true", help="queue on the node class's GPU worker")

    def handle(self, *args, **opts) -> None:
        if opts["threads"]:
            torch.set_num_threads(opts["threads"])
        if opts["max_prompt_tokens"] < 1 or opts["new_tokens"] < 1:
            raise CommandError("--max-prompt-tokens and --new-tokens must be at least 1", returncode=2)
        options = {"max_prompts": opts["max_prompts"], "new_tokens": opts["new_tokens"],
                   "max_prompt_tokens": opts["max_prompt_tokens"],
                   "intermediate_size": opts["intermediate_size"], "text_windows": opts["text_windows"]}  # fmt: skip
        if opts["lr"] is not None:
            options["lr"] = opts["lr"]
        if opts["multi_layer"]:  # EAGLE-3's token-led loss (docs/BENCHMARKS.md, "EAGLE heads")
            options.update(MULTI_LAYER_WEIGHTS)
        for name in ("token_weight", "feature_weight", "context_weight"):
            if opts[name] is not None:
                options[name] = opts[name]
        if opts["patience"]:
            options["patience"] = opts["patience"]
        if opts["multi_layer"]:
            options["multi_layer"] = True
        if opts["unroll"] != 1:
            options["unroll"] = opts["unroll"]
        fields = {
            "target_dir": opts["target"], "out_dir": opts["out"], "name": opts["name"],
            "target_name": opts["target_name"], "prompts": opts["prompts"], "epochs": opts["epochs"],
            "seed": opts["seed"], "node_class": opts["node_class"], "options": options, "init_from": opts["init_from"],
        }  # fmt: skip
        try:
            if opts["queue"]:
                run = start_training_run(**fields)
                self.stdout.write(f"training run {run.pk} queued on gpu.{run.node_class}")
                return
            run = self._resumable(fields) or create_training_run(**fields)
        except ValidationError as exc:
            message = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
            raise CommandError(message, returncode=2) from exc  # bad input: exit 2, nothing recorded
        self.stdout.write(f"training run {run.pk}: {run.name} -> {run.out_dir}")
        try:
            run = run_training(run=run, echo=_Echo(self), register=not opts["no_register"])
        except Exception as exc:
            raise CommandError(f"training run {run.pk} failed: {exc} (run the same command again to resume)") from exc
        draft = f"registered as draft {run.draft.name!r} (id {run.draft.pk})" if run.draft else "not registered"
        self.stdout.write(self.style.SUCCESS(
            f"done: held-out alpha {run.alpha:.3f}, mean accepted len {run.mean_accepted_len:.3f}; {draft}"
        ))  # fmt: skip

    def _resumable(self, fields: dict) -> TrainingRun | None:
        """The unfinished run recorded for this out directory, if any (a restart after a crash)."""
        from pathlib import Path

        out_dir = str(Path(fields["out_dir"]).resolve())
        run = TrainingRun.objects.filter(out_dir=out_dir).exclude(status=TrainingStatus.DONE).first()
        if run is not None:
            self.stdout.write(f"resuming training run {run.pk} (status {run.status}, epoch {run.epoch})")
        return run
