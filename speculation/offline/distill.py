"""Fine-tune a draft model on an endpoint's captured traffic (free of Django: the service hands the sequences in).

Sequence-level distillation: a capture holds the target's own served output, so the draft learns those tokens by
cross-entropy on the output positions (the prompt is context only), continuing from its weights. No target pass:
token-level KL would need the target's logits, which ACE holds only where a policy names a local target. The
captures the EAGLE path holds out (the oldest of each workload: eagle.prompts.split_prompts) measure each epoch;
the epoch with the best held-out mean accepted length is saved, safetensors + config + the draft's own tokenizer
files. Held-out acceptance is greedy speculative decoding replayed on the served output: the draft proposes k tokens
from the served prefix, the leading ones equal to the served tokens are accepted, the next served token is the
target's own (exact for greedy captures, a proxy for sampled ones). A crashed run starts again from the draft.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from speculation.offline.eagle.prompts import CapturedSequence, split_prompts
from speculation.offline.eagle.settings import EpochReport, PipelineSettings, Progress, kept_report

logger = logging.getLogger(__name__)

# Files of the draft's directory that travel with the weights unchanged (config.json is written by save_pretrained).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
UNLABELLED = "captured"


@dataclass(frozen=True)
class Acceptance:
    alpha: float  # share of drafted tokens accepted
    mean_accepted_len: float  # tokens per verification step (accepted + the target's own)
    categories: dict


@dataclass
class DistillResult:
    draft_dir: Path
    reports: list[EpochReport]
    original: Acceptance  # the draft it continued from, on the same held-out captures
    train_sequences: int
    held_out_sequences: int
    train_tokens: int

    @property
    def kept(self) -> EpochReport:
        return kept_report(self.reports)


def _saved_dtype(directory: Path) -> torch.dtype:
    """The dtype the draft was saved in (trained in float32, saved back the same)."""
    config = json.loads((directory / "config.json").read_text())
    dtype = getattr(torch, str(config.get("dtype") or config.get("torch_dtype") or "float32"), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _pairs(sequences: list[CapturedSequence], *, vocab: int, settings: PipelineSettings) -> list[tuple]:
    """(category, prompt ids, output ids) cut to max_prompt_tokens / new_tokens; ids outside vocab: skipped."""
    out, skipped = [], 0
    for s in sequences:
        prompt, output = s.prompt_ids[-settings.max_prompt_tokens :], s.output_ids[: settings.new_tokens]
        if not prompt or not output or max(prompt + output) >= vocab or min(prompt + output) < 0:
            skipped += 1
            continue
        out.append((s.category or UNLABELLED, prompt, output))
    if skipped:
        logger.warning("%d captured sequences skipped: empty, or ids outside the draft's vocabulary", skipped)
    return out


@torch.no_grad()
def _greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after ids, with the model's KV cache."""
    out = model(input_ids=torch.tensor([ids]), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def held_out_acceptance(model, pairs: list[tuple], *, k: int) -> Acceptance:
    """Greedy speculative decoding replayed on each served output (module docstring), pooled and per workload."""
    model.eval()
    totals: dict[str, list[int]] = {}  # category -> [steps, emitted, accepted, drafted]
    for category, prompt, output in pairs:
        t = totals.setdefault(category, [0, 0, 0, 0])
        pos = 0
        while pos < len(output):
            n = min(k, len(output) - pos)
            proposal = _greedy(model, prompt + output[:pos], n)
            match = next((i for i in range(n) if proposal[i] != output[pos + i]), n)
            emitted = min(match + 1, len(output) - pos)
            t[0], t[1], t[2], t[3] = t[0] + 1, t[1] + emitted, t[2] + match, t[3] + n
            pos += emitted

    def summary(t: list[int]) -> tuple[float, float]:
        return (t[2] / t[3] if t[3] else 0.0), (t[1] / t[0] if t[0] else 0.0)

    pooled = [sum(t[i] for t in totals.values()) for i in range(4)]
    alpha, mal = summary(pooled)
    categories = {c: dict(zip(("alpha", "mean_accepted_len"), summary(t), strict=True)) for c, t in totals.items()}
    return Acceptance(alpha=alpha, mean_accepted_len=mal, categories=categories)


def _batch(pairs: list[tuple], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, attention mask and labels (-100 on prompt and padding) of a few sequences."""
    length = max(len(p) + len(o) for _, p, o in pairs)
    ids = torch.full((len(pairs), length), pad, dtype=torch.long)  # [B, S]
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, (_, prompt, output) in enumerate(pairs):
        n = len(prompt) + len(output)
        ids[row, :n] = torch.tensor(prompt + output)
        labels[row, len(prompt) : n] = torch.tensor(output)
        mask[row, :n] = 1
    return ids, mask, labels


def _epoch(model, optimizer, pairs: list[tuple], *, settings: PipelineSettings, pad: int, step: int, rng) -> tuple:
    """One pass over the training pairs, shuffled; (mean loss, steps so far)."""
    train = settings.train
    model.train()
    order = list(pairs)
    rng.shuffle(order)
    losses = []
    for start in range(0, len(order), train.batch_size):
        ids, mask, labels = _batch(order[start : start + train.batch_size], pad)
        for group in optimizer.param_groups:
            group["lr"] = train.lr * min(1.0, (step + 1) / max(1, train.warmup_steps))
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        step += 1
    return sum(losses) / len(losses), step


def distill_on_captures(
    *, draft_dir: Path, out_dir: Path, sequences: list[CapturedSequence], settings: PipelineSettings, progress: Progress
) -> DistillResult:
    """Fine-tune the draft in draft_dir on the captures and save the best epoch's weights in out_dir."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(settings.train.seed)
    progress.stage("load", str(draft_dir))
    model = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32)
    saved_dtype = _saved_dtype(draft_dir)
    vocab = model.get_input_embeddings().weight.shape[0]
    train_part, test_part = split_prompts(sequences, held_out=settings.held_out)
    train = _pairs(train_part, vocab=vocab, settings=settings)
    held = _pairs(test_part, vocab=vocab, settings=settings)
    if not train or not held:
        raise ValueError(
            f"{len(sequences)} captured requests leave {len(train)} to train on and {len(held)} held out within the "
            "draft's vocabulary: too few, or captured from a model with another tokenizer"
        )
    progress.stage("collect", f"{len(train)} training and {len(held)} held-out captured requests")
    k = settings.train.eval_k
    original = held_out_acceptance(model, held, k=k)
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.train.lr, weight_decay=0.0)
    rng, step, reports, best, best_state = random.Random(settings.train.seed), 0, [], None, None
    for epoch in range(1, settings.train.epochs + 1):
        progress.stage("train", f"epoch {epoch}")
        started = time.perf_counter()
        loss, step = _epoch(model, optimizer, train, settings=settings, pad=pad, step=step, rng=rng)
        acceptance = held_out_acceptance(model, held, k=k)
        if best is None or acceptance.mean_accepted_len > best.mean_accepted_len:
            best = acceptance
            best_epoch, best_state = epoch, {n: t.detach().clone() for n, t in model.state_dict().items()}
        report = EpochReport(epoch=epoch, epochs=settings.train.epochs, loss=loss, feature_loss=0.0, token_loss=loss,
                             alpha=acceptance.alpha, mean_accepted_len=acceptance.mean_accepted_len,
                             acceptance_rate=acceptance.alpha, seconds=time.perf_counter() - started,
                             categories=acceptance.categories, best_epoch=best_epoch)  # fmt: skip
        reports.append(report)
        progress.epoch(report)
        if settings.train.patience and epoch - best_epoch >= settings.train.patience:
            break
    progress.stage("save", str(out_dir))
    model.load_state_dict(best_state)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(saved_dtype).save_pretrained(str(out_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (draft_dir / name).is_file():
            shutil.copyfile(draft_dir / name, out_dir / name)
    tokens = sum(len(p) + len(o) for _, p, o in train)
    return DistillResult(draft_dir=out_dir, reports=reports, original=original, train_sequences=len(train),
                         held_out_sequences=len(held), train_tokens=tokens)  # fmt: skip
