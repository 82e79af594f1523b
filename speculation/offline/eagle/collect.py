"""Collect the target's features: its greedy continuation of each prompt and its last hidden state everywhere.

Training on the target's own continuations (not on fixed text) shows the head the sequences it will draft
for at inference time. Features are the final-norm output of the target's last layer, which is what its LM
head reads (and what vLLM hands an EAGLE head); with ``feature_layers`` (EAGLE-3) the outputs of those layers
come first, concatenated: [low, mid, high], as the engine's Transformer returns them (engine.model).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculation.offline.eagle.prompts import Prompt

logger = logging.getLogger(__name__)

TEXT_WINDOW = "text"  # the category of a teacher-forced text window (collect_text_windows)


@dataclass
class Sequences:
    """Token ids [T] and features [T, H] per sequence; tokens[:prompt_len] is the prompt."""

    tokens: list[torch.Tensor] = field(default_factory=list)
    features: list[torch.Tensor] = field(default_factory=list)
    prompt_lens: list[int] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def total_tokens(self) -> int:
        return sum(t.numel() for t in self.tokens)

    def extend(self, other: Sequences) -> None:
        self.tokens += other.tokens
        self.features += other.features
        self.prompt_lens += other.prompt_lens
        self.categories += other.categories

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save(self.__dict__, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> Sequences:
        return cls(**torch.load(path, weights_only=True))


def load_target(target_dir: Path, device: str = "cpu"):
    """The target as a transformers Llama in float32, with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
    return model, tokenizer


def target_weights(model) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding [V, H] and LM head [V, H] (the head reuses both, never trains them)."""
    return model.get_input_embeddings().weight.detach(), model.get_output_embeddings().weight.detach()


@torch.no_grad()
def collect(
    model,
    tokenizer,
    prompts: list[Prompt],
    *,
    max_prompt_tokens: int = 64,
    new_tokens: int = 64,
    batch_size: int = 16,
    progress=None,
    feature_layers: tuple[int, ...] = (),
    both_ends: bool = False,
) -> Sequences:
    """Greedy-continue each prompt with the target (batched, left padded), then record its features.

    A prompt longer than max_prompt_tokens keeps its last tokens; with both_ends it also gives a second sequence
    from its first tokens (a long document cut where the text goes on, as a client that truncates sends it)."""
    device = next(model.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    out = Sequences()
    cuts = _cut_prompts(tokenizer, prompts, max_prompt_tokens, both_ends)
    for start in range(0, len(cuts), batch_size):
        chunk = [prompt for prompt, _ in cuts[start : start + batch_size]]
        encoded = [ids for _, ids in cuts[start : start + batch_size]]
        width = max(len(ids) for ids in encoded)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, seq in enumerate(encoded):  # left padding: every prompt ends at the same column
            ids[row, width - len(seq) :] = torch.tensor(seq)
            mask[row, width - len(seq) :] = 1
        generated = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
        )[:, width:].cpu()
        sequences = []
        for row, seq in enumerate(encoded):
            continuation = generated[row].tolist()
            if eos_id in continuation:
                continuation = continuation[: continuation.index(eos_id) + 1]
            sequences.append(torch.tensor(seq + continuation, dtype=torch.long))
        for prompt, seq, prompt_ids in zip(chunk, sequences, encoded, strict=True):
            hidden = features_of(model, seq[None].to(device), feature_layers)[0].cpu()  # [T, (n + 1) * H]
            out.tokens.append(seq)
            out.features.append(hidden)
            out.prompt_lens.append(len(prompt_ids))
            out.categories.append(prompt.category)
        if progress is not None:
            progress(min(start + batch_size, len(cuts)), len(cuts))
    logger.info("collected %d sequences, %d tokens", len(out), out.total_tokens)
    return out


def _cut_prompts(tokenizer, prompts: list[Prompt], max_tokens: int, both_ends: bool) -> list[tuple[Prompt, list]]:
    cuts = []
    for prompt in prompts:
        ids = tokenizer(prompt.text, add_special_tokens=True)["input_ids"]
        cuts.append((prompt, ids[-max_tokens:]))
        if both_ends and len(ids) > max_tokens:
            cuts.append((prompt, ids[:max_tokens]))
    return cuts


def features_of(model, input_ids: torch.Tensor, feature_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """[B, T] ids -> [B, T, (n + 1) * H]: the outputs of feature_layers, then the final-norm feature."""
    if not feature_layers:
        return model.model(input_ids=input_ids).last_hidden_state
    out = model.model(input_ids=input_ids, output_hidden_states=True)
    # hidden_states[0] is the embedding output, hidden_states[i + 1] layer i's output (the last one normed)
    return torch.cat([*(out.hidden_states[i + 1] for i in feature_layers), out.last_hidden_state], dim=-1)


@torch.no_grad()
def collect_text_windows(
    model,
    tokenizer,
    text: str,
    *,
    windows: int,
    window_tokens: int = 128,
    batch_size: int = 16,
    feature_layers: tuple[int, ...] = (),
) -> Sequences:
    """Teacher-forced features over evenly spaced windows of text: one batched target pass, no generation.

    Cheap volume (as the EAGLE paper trains on fixed text); the generated continuations carry the
    distribution the head drafts at inference time.
    """
    device = next(model.parameters()).device
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < window_tokens + 1:
        return Sequences()
    stride = max(window_tokens, (len(ids) - window_tokens) // max(1, windows))
    starts = list(range(0, len(ids) - window_tokens, stride))[:windows]
    out = Sequences()
    for first in range(0, len(starts), batch_size):
        batch = torch.tensor([ids[s : s + window_tokens] for s in starts[first : first + batch_size]])
        hidden = features_of(model, batch.to(device), feature_layers).cpu()  # [B, T, (n + 1) * H]
        for row in range(batch.shape[0]):
            out.tokens.append(batch[row])
            out.features.append(hidden[row].clone())
            out.prompt_lens.append(1)
            out.categories.append(TEXT_WINDOW)
    logger.info("teacher-forced %d text windows of %d tokens", len(out), window_tokens)
    return out
