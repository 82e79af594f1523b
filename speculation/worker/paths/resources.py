"""What a GPU worker process keeps loaded: models and tokenizers by directory (loaded once, LRU-bounded).

Models are the engine's (speculation.engine.load_causal_lm on settings.ENGINE_DEVICE in ENGINE_DTYPE: ``placement``;
a KV cache row held by the model), so one loaded model serves one generation at a time: the worker runs one task per
process (prefork, concurrency 1).

Bounded memory: at most MAX_LOADED models and MAX_LOADED EAGLE heads, and the models' bytes (weights and the
KV cache row they hold) within settings.WORKER_MODEL_MB; the least recently used goes first, never the one just
loaded. So one target with several drafts (`draft: auto` picks a candidate per request) stays loaded together while
they fit, and a worker serving many endpoints reloads rather than grows.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAX_LOADED = 4


@dataclass(frozen=True)
class Loaded:
    directory: str
    model: Any
    tokenizer: Any
    eos_ids: frozenset[int]


_loaded: OrderedDict[str, Loaded] = OrderedDict()
_tokenizers: dict[str, Any] = {}
_heads: OrderedDict[tuple[str, str], Any] = OrderedDict()
_lock = threading.Lock()


def tokenizer(directory: str) -> Any:
    from transformers import AutoTokenizer

    with _lock:
        found = _tokenizers.get(directory)
        if found is None:
            found = _tokenizers[directory] = AutoTokenizer.from_pretrained(directory)
        return found


def placement() -> tuple[str, Any]:
    """(device, dtype) for load_causal_lm from settings.ENGINE_DEVICE and ENGINE_DTYPE (dtype None, "auto": float32
    on the CPU, the checkpoint's half precision on CUDA); a CUDA device where torch sees none is refused, named."""
    import torch
    from django.conf import settings

    device, dtype = settings.ENGINE_DEVICE, settings.ENGINE_DTYPE
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"ACE_ENGINE_DEVICE={device}, but torch sees no CUDA device on this worker")
    return device, None if dtype == "auto" else getattr(torch, dtype)


def model(directory: str) -> Loaded:
    """The causal LM in `directory` (the engine's, on the configured device: ``placement``) with its tokenizer; loaded
    on first use."""
    from speculation.engine import load_causal_lm
    from speculation.worker.paths.text import eos_token_ids

    with _lock:
        found = _loaded.get(directory)
        if found is not None:
            _loaded.move_to_end(directory)
            return found
    if not (Path(directory) / "config.json").is_file():
        raise FileNotFoundError(f"{directory} holds no config.json")
    logger.info("loading %s", directory)
    tok = tokenizer(directory)
    device, dtype = placement()
    loaded = Loaded(
        directory=directory,
        model=load_causal_lm(directory, device=device, dtype=dtype),
        tokenizer=tok,
        eos_ids=eos_token_ids(directory, tok),
    )
    with _lock:
        _loaded[directory] = loaded
        _evict()
    return loaded


def model_bytes(found: Loaded) -> int:
    """The bytes a loaded model holds: its weights and buffers, and its KV cache row as it stands (it grows with the
    longest request the model has run)."""
    tensors = list(found.model.parameters()) + list(found.model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors) + getattr(found.model, "cache_bytes", 0)


def loaded_bytes() -> int:
    with _lock:
        return sum(model_bytes(found) for found in _loaded.values())


def budget_bytes() -> int:
    """settings.WORKER_MODEL_MB in bytes (0: no byte bound, MAX_LOADED only)."""
    from django.conf import settings

    return int(getattr(settings, "WORKER_MODEL_MB", 0)) * 2**20


def _evict() -> None:
    """Drop the least recently used models beyond MAX_LOADED or the byte budget (the newest always stays)."""
    budget = budget_bytes()
    sizes = {directory: model_bytes(found) for directory, found in _loaded.items()}
    while len(_loaded) > 1 and (len(_loaded) > MAX_LOADED or (budget and sum(sizes.values()) > budget)):
        directory, _ = _loaded.popitem(last=False)
        logger.info("unloading %s (%.0f MB): over the worker's model budget", directory, sizes.pop(directory) / 2**20)


def eagle_head(directory: str, *, target_dir: str) -> Any:
    """The EAGLE head in `directory` (refused when trained for another target than target_dir's); loaded on first
    use. Each request drafts with its own EagleProposer over it (the worker runs one task per process)."""
    from speculation.engine.eagle import EagleHead

    key = (directory, target_dir)
    with _lock:
        found = _heads.get(key)
        if found is not None:
            _heads.move_to_end(key)
            return found
    logger.info("loading the EAGLE head %s", directory)
    head = EagleHead.load(Path(directory), target_dir=Path(target_dir), device=placement()[0])
    with _lock:
        _heads[key] = head
        while len(_heads) > MAX_LOADED:
            _heads.popitem(last=False)
    return head


def shared_vocab(draft: Loaded, target_vocab: int) -> int | None:
    """None where the draft's vocabulary has the target's size; else the ids of the tokenizer they share
    (checkpoints pad vocab_size past it, to sizes that differ: speculation.engine.vocab)."""
    return None if draft.model.vocab_size == target_vocab else len(draft.tokenizer)


def draft_width(draft: Loaded, target_path: str = "") -> int:
    """The ids ``draft`` drafts among against the target in target_path (none: the server's, which generates the
    tokenizer's ids only): as prod's local path drafts, so that shadow's replays of it draft alike."""
    from speculation.engine.vocab import draft_width as width

    target_vocab = (target_vocab_size(target_path) if target_path else None) or draft.model.vocab_size
    return width(draft.model.vocab_size, target_vocab, shared_vocab(draft, target_vocab))


def target_vocab_size(directory: str) -> int | None:
    """The vocabulary size of the model in directory: the loaded model's, else its config.json's (nothing is
    loaded for it); None where it cannot be read (prod refuses such a target_path anyway)."""
    with _lock:
        found = _loaded.get(directory)
    if found is not None:
        return found.model.vocab_size
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
        return int((config.get("text_config") or config)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
