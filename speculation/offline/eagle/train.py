"""Train an EAGLE head on collected target features: feature regression + token cross-entropy (EAGLE-1).

Loss per position i (EAGLE paper, section 4): SmoothL1(g_{i+1}, f_{i+1}) + w_token * CE(p_{i+1}, q_{i+1}),
where p is the target's distribution LM_head(f_{i+1}) and q = LM_head(g_{i+1}) the head's. Input features get
small uniform noise, as in the paper, so the head tolerates its own prediction errors when drafting.

Deterministic with a seed (every random draw goes through a generator seeded from (seed, epoch)) and
resumable: a checkpoint is written atomically after each epoch and a restart continues from it.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from speculation.engine.eagle import EagleHead, init_weights
from speculation.offline.eagle.collect import TEXT_WINDOW, Sequences
from speculation.offline.eagle.evaluate import ReplayStats, bootstrap_interval, replay_each
from speculation.offline.eagle.settings import EpochReport, TrainSettings

__all__ = ["EpochReport", "TrainSettings", "TrainingInterrupted", "train_head"]

logger = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"


class TrainingInterrupted(RuntimeError):
    """Raised by a progress callback to stop after a checkpoint (tests simulate a crash with it)."""


def _batches(data: Sequences, order: list[int], batch_size: int, context_weight: float = 1.0):
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        width = max(data.tokens[r].numel() for r in rows)
        hidden = data.features[rows[0]].shape[-1]
        tokens = torch.zeros((len(rows), width), dtype=torch.long)
        features = torch.zeros((len(rows), width, hidden))
        weights = torch.zeros((len(rows), width - 1))
        for i, r in enumerate(rows):
            n = data.tokens[r].numel()
            tokens[i, :n] = data.tokens[r]
            features[i, :n] = data.features[r]
            weights[i, : n - 1] = position_weights(data, r, context_weight)
        yield tokens, features, weights


def position_weights(data: Sequences, row: int, context_weight: float) -> torch.Tensor:
    """Loss weights [T - 1] of one sequence, indexed as the features predicted (entry j: f_{j+1}, whose LM head
    gives token x_{j+2}): 1 where that token is the target's own continuation (what the head drafts for at
    inference), ``context_weight`` where it is prompt text or a teacher-forced text window."""
    n = data.tokens[row].numel()
    weights = torch.ones(n - 1)
    if data.categories[row] == TEXT_WINDOW:
        return weights * context_weight
    first_generated = max(0, data.prompt_lens[row] - 2)  # x_{j+2} generated from j = prompt_len - 2 on
    weights[:first_generated] = context_weight
    return weights


def losses(head: EagleHead, embed, lm_head, tokens, features, valid, settings: TrainSettings, generator=None):
    """(total, feature, token) losses of one batch; tokens [B, T], features [B, T, W], valid [B, T-1] (a mask, or
    each position's loss weight: ``position_weights``).

    W is H, or (n + 1) * H for a multi-layer head (the final-norm feature last: what the head predicts). With
    ``settings.unroll`` > 1 the later drafting steps' losses (training-time test) are averaged in.
    """
    inputs = features[:, :-1]  # f_i
    if generator is not None and settings.noise > 0:
        scale = settings.noise * inputs.pow(2).mean().sqrt()
        # drawn on the CPU generator whatever the device, so a seed gives the same noise everywhere
        noise = (torch.rand(inputs.shape, generator=generator) * 2 - 1).to(inputs.device)
        inputs = inputs + noise * scale
    final = features[..., -head.config.hidden_size :]  # [B, T, H]: the final-norm features f
    if settings.unroll == 1:
        steps = [head(inputs, F.embedding(tokens[:, 1:], embed))]  # g_{i+1}  [B, T-1, H]
    else:
        steps = unrolled(head, embed, tokens, inputs, settings.unroll)
    feature_loss = token_loss = 0.0
    for s, predicted in enumerate(steps, start=1):  # step s predicts f_{i+s}
        predicted = predicted[:, : final.shape[1] - s]
        f_loss, t_loss = _step_losses(head, predicted, final[:, s:], valid[:, s - 1 :], lm_head)
        feature_loss, token_loss = feature_loss + f_loss / len(steps), token_loss + t_loss / len(steps)
    return settings.feature_weight * feature_loss + settings.token_weight * token_loss, feature_loss, token_loss


def _step_losses(head, predicted, target, valid, lm_head):
    """SmoothL1 to the target's feature and cross-entropy to its distribution: the mean over the valid positions,
    weighted by ``valid`` when it holds weights. An EAGLE-3 head's feature is its output through its own norm."""
    count = valid.sum().clamp(min=1e-6) if valid.is_floating_point() else valid.sum().clamp(min=1)
    feature = head.feature_of(predicted)
    feature_loss = (F.smooth_l1_loss(feature, target, reduction="none").mean(-1) * valid).sum() / count
    with torch.no_grad():
        p = F.softmax(target @ lm_head.T, dim=-1)  # [B, T', V]
    log_q = F.log_softmax(head.logits(predicted, lm_head), dim=-1)
    token_loss = (-(p * log_q).sum(-1) * valid).sum() / count
    return feature_loss, token_loss


def unrolled(head: EagleHead, embed, tokens, inputs, steps: int) -> list[torch.Tensor]:
    """Training-time test: the head's predictions after 1..steps drafting steps, [B, L, H] each (L = T - 1).

    Step s at root j reads the head's own prediction from step s - 1 (step 1: the true feature f_j) with token
    x_{j+s}, at position j + s - 1, and attends as at inference: to the true pairs up to j and to its own
    earlier drafts from root j. All steps run as one sequence of segments with that attention mask.
    """
    b, length, _ = inputs.shape
    padded = F.pad(tokens, (0, steps))  # tokens past the end: masked out of the losses
    true = head.fuse_true(inputs)  # [B, L, H]
    embeds = [F.embedding(padded[:, s : s + length], embed) for s in range(1, steps + 1)]
    features = [true]
    for s in range(1, steps + 1):
        mask, positions = unroll_mask(length, s, inputs.device)
        out = head(torch.cat(features, dim=1), torch.cat(embeds[:s], dim=1), positions=positions, mask=mask)
        outputs = out.split(length, dim=1)
        if s < steps:
            features.append(outputs[-1])
    return list(outputs)


def unroll_mask(length: int, segments: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask [S*L, S*L] and positions [S*L] of ``segments`` drafting steps over L roots (see ``unrolled``)."""
    j = torch.arange(length, device=device)
    causal, eye = j[None, :] <= j[:, None], torch.eye(length, dtype=torch.bool, device=device)
    none = torch.zeros_like(eye)
    rows = [torch.cat([causal] + [eye if r <= s else none for r in range(1, segments)], dim=1) for s in range(segments)]
    positions = torch.cat([j + s for s in range(segments)])
    return torch.cat(rows, dim=0), positions


def _schedule(settings: TrainSettings, total_steps: int) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def train_head(
    head: EagleHead,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    train: Sequences,
    held_out: Sequences,
    settings: TrainSettings,
    *,
    work_dir: Path,
    on_epoch: Callable[[EpochReport], None] | None = None,
    initial: dict[str, torch.Tensor] | None = None,
) -> list[EpochReport]:
    """Train (or resume training) the head on embed's device; returns every epoch's report, resumed ones included.
    initial: weights to start from (a saved head's, to train it further) instead of the seeded initialisation."""
    work_dir.mkdir(parents=True, exist_ok=True)
    head.to(embed.device)
    steps_per_epoch = math.ceil(len(train) / settings.batch_size)
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule(settings, steps_per_epoch * settings.epochs))
    reports: list[EpochReport] = []
    first_epoch = 1
    best: dict = {"epoch": 0, "score": -1.0, "head": None, "stopped": False}  # the epoch kept (held-out E[N])
    checkpoint = work_dir / CHECKPOINT
    if checkpoint.is_file():
        # weights_only: a checkpoint is tensors, numbers, strings and containers; never unpickle code.
        try:
            state = torch.load(checkpoint, weights_only=True, map_location=embed.device)
        except pickle.UnpicklingError as exc:
            raise ValueError(f"{checkpoint} is not a checkpoint ACE wrote (refused to unpickle it)") from exc
        if state["settings"] != asdict(settings):
            raise ValueError(f"{checkpoint} was written with other settings: {state['settings']}; use a new --out")
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        reports = [EpochReport(**r) for r in state["reports"]]
        best = state["best"]
        first_epoch = settings.epochs + 1 if best["stopped"] else state["epoch"] + 1
        logger.info("resuming from %s after epoch %d", checkpoint, state["epoch"])
    elif initial is not None:
        head.load_state_dict(initial)
    else:
        init_weights(head, torch.Generator().manual_seed(settings.seed))
    for epoch in range(first_epoch, settings.epochs + 1):
        started = time.perf_counter()
        generator = torch.Generator().manual_seed(settings.seed * 1000 + epoch)
        order = torch.randperm(len(train), generator=generator).tolist()
        head.train()
        sums = torch.zeros(3)
        for batch in _batches(train, order, settings.batch_size, settings.context_weight):
            tokens, features, valid = (t.to(embed.device) for t in batch)
            loss, feature_loss, token_loss = losses(head, embed, lm_head, tokens, features, valid, settings, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), settings.grad_clip)
            optimizer.step()
            scheduler.step()
            sums += torch.tensor([loss.item(), feature_loss.item(), token_loss.item()])
        means = (sums / steps_per_epoch).tolist()
        sequences = replay_each(head, embed, lm_head, held_out, k=settings.eval_k)
        pooled, by_category = _pool(sequences, settings.eval_k)
        if pooled.mean_accepted_len > best["score"]:
            best = {"epoch": epoch, "score": pooled.mean_accepted_len, "head": _copy(head), "stopped": False}
        best["stopped"] = bool(settings.patience) and epoch - best["epoch"] >= settings.patience
        held_out_stats = [stats for _, stats in sequences]
        report = EpochReport(
            epoch=epoch,
            epochs=settings.epochs,
            loss=means[0],
            feature_loss=means[1],
            token_loss=means[2],
            alpha=round(pooled.alpha, 4),
            mean_accepted_len=round(pooled.mean_accepted_len, 4),
            acceptance_rate=round(pooled.acceptance_rate, 4),
            seconds=time.perf_counter() - started,
            categories={name: stats.as_dict() for name, stats in sorted(by_category.items())},
            alpha_interval=bootstrap_interval(held_out_stats, "alpha", seed=settings.seed),
            mean_accepted_len_interval=bootstrap_interval(held_out_stats, "mean_accepted_len", seed=settings.seed),
            best_epoch=best["epoch"],
        )
        reports.append(report)
        _save_checkpoint(checkpoint, head, optimizer, scheduler, epoch, reports, settings, best)
        logger.info("epoch %d/%d loss %.4f alpha %.3f %s tau %.3f", epoch, settings.epochs, report.loss,
                    report.alpha, report.alpha_interval, report.mean_accepted_len)  # fmt: skip
        if on_epoch is not None:
            on_epoch(report)
        if best["stopped"]:
            logger.info("early stop after epoch %d: no better held-out acceptance since epoch %d", epoch, best["epoch"])
            break
    if best["head"] is not None:
        head.load_state_dict(best["head"])  # the best epoch's weights, not the last one's
    return reports


def _pool(sequences: list[tuple[str, ReplayStats]], k: int) -> tuple[ReplayStats, dict[str, ReplayStats]]:
    pooled, by_category = ReplayStats(k), {}
    for category, stats in sequences:
        pooled.merge(stats)
        by_category.setdefault(category, ReplayStats(k)).merge(stats)
    return pooled, by_category


def _copy(head: EagleHead) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in head.state_dict().items()}


def _save_checkpoint(
    path: Path, head, optimizer, scheduler, epoch: int, reports, settings: TrainSettings, best: dict
) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "best": best,
            "epoch": epoch,
            "head": head.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "reports": [asdict(r) for r in reports],
            "settings": asdict(settings),
        },
        tmp,
    )
    tmp.replace(path)
