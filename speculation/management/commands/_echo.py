"""A training run's progress printed by a management command (train_eagle, distill_draft): its stages, and one line
per epoch (``line``; a command that has more to say per epoch overrides it)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from speculation.offline.eagle.settings import EpochReport, Progress


class CommandEcho(Progress):
    def __init__(self, command: BaseCommand) -> None:
        self.out = command.stdout

    def stage(self, name: str, detail: str = "") -> None:
        self.out.write(f"[{name}] {detail}")

    def epoch(self, report: EpochReport) -> None:
        self.out.write(self.line(report))

    def line(self, report: EpochReport) -> str:
        return (
            f"epoch {report.epoch}/{report.epochs}  loss {report.loss:.4f}  held-out alpha {report.alpha:.3f}  "
            f"mean accepted len {report.mean_accepted_len:.3f}  best epoch {report.best_epoch}"
        )
