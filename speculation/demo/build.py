"""Build (once) and locate the demo target/draft pair under ``$ACE_HOME/models/demo-v1``.

The build writes into a temporary directory and renames it into place, so a crashed build is never used;
a lock file keeps two processes from building at the same time.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from speculation.demo.corpus import stdlib_corpus
from speculation.demo.tokenizer import BOS, EOS, PAD, save_tokenizer, train_tokenizer
from speculation.demo.train import (
    DRAFT_SHAPE,
    MAX_POSITIONS,
    TARGET_SHAPE,
    TrainPlan,
    bigram_init,
    distill_draft,
    greedy_agreement,
    greedy_continuations,
    llama_config,
    train_target,
)

logger = logging.getLogger(__name__)

DEMO_NAME = "demo-v3"  # v1, v2: earlier recipes (v2: draft distilled on code only)
SEED = 20261129
VOCAB_SIZE = 2048
TOKENIZER_BYTES = 1_500_000
TRAIN_BYTES = 3_000_000
HELD_OUT_BYTES = 400_000
PROSE_BYTES = 600_000
BUILD_INFO = "build_info.json"
BUILD_THREADS = 1


@dataclass(frozen=True)
class DemoPair:
    root: Path
    target_dir: Path
    draft_dir: Path

    @property
    def build_info(self) -> dict:
        return json.loads((self.root / BUILD_INFO).read_text())


def ace_home() -> Path:
    return Path(os.environ.get("ACE_HOME") or Path.home() / ".cache" / "ace")


def ensure_demo_pair(*, models_dir: Path | None = None) -> DemoPair:
    """Return the demo pair, building it first (a few minutes on 2 CPU cores) if it is not cached."""
    models_dir = models_dir or ace_home() / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    final = models_dir / DEMO_NAME
    pair = DemoPair(root=final, target_dir=final / "target", draft_dir=final / "draft")
    if final.is_dir():
        return pair
    with _locked(models_dir / f"{DEMO_NAME}.lock"):
        if final.is_dir():  # another process built it while we waited
            return pair
        for stale in models_dir.glob(f".{DEMO_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = models_dir / f".{DEMO_NAME}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            build_demo_pair(tmp)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return pair


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_demo_pair(out: Path, plan: TrainPlan | None = None) -> dict:
    """Train and save the pair into ``out``; one torch thread, so the weights do not depend on the core count
    (and a shared machine's other jobs do not stall the thread barrier)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        return _build(out, plan or TrainPlan())
    finally:
        torch.set_num_threads(threads)


def _build(out: Path, plan: TrainPlan) -> dict:
    started = time.perf_counter()
    torch.manual_seed(SEED)
    corpus = stdlib_corpus()
    train_text = corpus.train_text(max(TOKENIZER_BYTES, TRAIN_BYTES))
    tokenizer = train_tokenizer(train_text[:TOKENIZER_BYTES], vocab_size=VOCAB_SIZE)
    ids = torch.tensor(tokenizer.encode(train_text[:TRAIN_BYTES], add_special_tokens=False).ids)
    prose_ids = torch.tensor(tokenizer.encode(corpus.prose_text(PROSE_BYTES), add_special_tokens=False).ids)
    held_ids = torch.tensor(tokenizer.encode(corpus.held_out_text(HELD_OUT_BYTES), add_special_tokens=False).ids)
    logger.info(
        "tokenizer: %d tokens of training text, %d held out (%.0fs)",
        ids.numel(),
        held_ids.numel(),
        time.perf_counter() - started,
    )
    special = {
        "bos_id": tokenizer.token_to_id(BOS),
        "eos_id": tokenizer.token_to_id(EOS),
        "pad_id": tokenizer.token_to_id(PAD),
    }
    vocab = tokenizer.get_vocab_size()

    torch.manual_seed(SEED + 1)
    target = LlamaForCausalLM(llama_config(TARGET_SHAPE, vocab_size=vocab, **special))
    bigram_init(target, ids)
    target_loss = train_target(target, ids, plan, seed=SEED + 2)
    torch.manual_seed(SEED + 3)
    draft = LlamaForCausalLM(llama_config(DRAFT_SHAPE, vocab_size=vocab, **special))
    bigram_init(draft, ids)
    draft_kl = distill_draft(draft, target, ids, plan, seed=SEED + 4, prose_ids=prose_ids)

    info = _evaluate(target, draft, held_ids, plan, seed=SEED + 5)
    info.update(
        name=DEMO_NAME,
        seed=SEED,
        vocab_size=vocab,
        target_final_loss=round(target_loss, 4),
        draft_final_kl=round(draft_kl, 4),
        target_params=sum(p.numel() for p in target.parameters()),
        draft_params=sum(p.numel() for p in draft.parameters()),
        train_tokens=ids.numel(),
        held_out_tokens=held_ids.numel(),
        build_seconds=round(time.perf_counter() - started, 1),
        torch_threads=torch.get_num_threads(),
    )
    for name, model in (("target", target), ("draft", draft)):
        directory = out / name
        model.save_pretrained(directory, safe_serialization=True)
        GenerationConfig(
            bos_token_id=special["bos_id"], eos_token_id=special["eos_id"], pad_token_id=special["pad_id"]
        ).save_pretrained(directory)
        save_tokenizer(tokenizer, directory, model_max_length=MAX_POSITIONS)
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    logger.info("demo pair built in %.0fs: %s", info["build_seconds"], info)
    return info


def _evaluate(
    target: LlamaForCausalLM, draft: LlamaForCausalLM, held_ids: torch.Tensor, plan: TrainPlan, seed: int
) -> dict:
    """Greedy acceptance (alpha) of the draft on held-out text: teacher forced, and on the target's own output."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, held_ids.numel() - 129, (16,), generator=generator).tolist()
    real = torch.stack([held_ids[s : s + 128] for s in starts])
    prompts = real[:, : plan.gen_prompt_len]
    generated = greedy_continuations(target, prompts, plan.gen_new_tokens)
    return {
        "alpha_heldout_text": round(greedy_agreement(draft, target, real, start=1), 4),
        "alpha_heldout_generated": round(greedy_agreement(draft, target, generated, start=plan.gen_prompt_len), 4),
    }
