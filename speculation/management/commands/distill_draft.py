"""Distil a draft model on an endpoint's captured traffic and register the result as a draft:

    python manage.py distill_draft --draft NAME_OR_DIR --out DIR --prompts captured:ENDPOINT[:WORKLOAD]
        [--epochs N] [--seed S] [--lr LR] [--queue]

A training run of kind draft_model (speculation.services.draft_distillation); prints the stages and one line per
epoch. Bad input (a draft of another tokenizer, an unknown endpoint) exits with code 2, nothing recorded.
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from speculation.management.commands._echo import CommandEcho
from speculation.services.draft_distillation import create_distillation_run, run_distillation, start_distillation_run


class Command(BaseCommand):
    help = "Fine-tune a draft model on an endpoint's captured traffic and register it (kind draft_model)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--draft", required=True, help="a registered draft model's name or its directory")
        parser.add_argument("--out", required=True, help="a new directory under ACE_MODEL_ROOTS for the draft")
        parser.add_argument("--prompts", required=True, help="captured:ENDPOINT[:WORKLOAD], several joined by commas")
        parser.add_argument("--epochs", type=int, default=4)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--lr", type=float, default=None, help="learning rate (default: a gentle fine-tune's)")
        parser.add_argument("--name", default="")
        parser.add_argument("--node-class", default="cpu")
        parser.add_argument("--queue", action="store_true", help="queue the run on the node class's GPU worker")

    def handle(self, *args, **opts) -> None:
        fields = {
            "draft": opts["draft"], "out_dir": opts["out"], "prompts": opts["prompts"], "epochs": opts["epochs"],
            "seed": opts["seed"], "name": opts["name"], "node_class": opts["node_class"],
            "options": {"lr": opts["lr"]} if opts["lr"] is not None else {},
        }  # fmt: skip
        try:
            if opts["queue"]:
                run = start_distillation_run(**fields)
                self.stdout.write(f"training run {run.pk} queued on gpu.{run.node_class}")
                return
            run = create_distillation_run(**fields)
        except ValidationError as exc:
            message = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
            raise CommandError(message, returncode=2) from exc
        self.stdout.write(f"training run {run.pk}: {run.name} -> {run.out_dir}")
        try:
            run = run_distillation(run=run, echo=CommandEcho(self))
        except Exception as exc:
            raise CommandError(f"training run {run.pk} failed: {exc}") from exc
        self.stdout.write(self.style.SUCCESS(
            f"done: held-out mean accepted len {run.mean_accepted_len:.3f}; registered as draft {run.draft.name!r}"
        ))  # fmt: skip
