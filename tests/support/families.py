"""Tiny random checkpoints of real model families that servers load as they load real ones.

Written by transformers' own config classes (speculation.bench.families.build_checkpoint: the family's real tensor
names and config keys), with the shipped demo target's tokenizer (a vocabulary of DEMO_VOCAB ids, the demo's special
tokens), so that vLLM, ACE's worker and the EAGLE training pipeline read them whole. A checkpoint may pad its
vocabulary past the tokenizer's, as Qwen's do.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from speculation.bench.families import FAMILY_CONFIGS, build_checkpoint

DEMO_VOCAB = 2048
SPECIAL = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}  # the demo tokenizer's
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "max_position_embeddings": 512}  # fmt: skip
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def copy_tokenizer(tokenizer_dir: Path, directory: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copyfile(Path(tokenizer_dir) / name, Path(directory) / name)


def family_checkpoint(
    directory: Path,
    family: str,
    *,
    tokenizer_dir: Path,
    seed: int = 0,
    layers: int = 4,
    vocab: int = DEMO_VOCAB,
    quiet_layers: float = 1.0,
    **shape: int,
) -> Path:
    """A random ``family`` checkpoint (speculation.bench.families.FAMILY_CONFIGS) of ``vocab`` ids in directory,
    with the tokenizer of tokenizer_dir; layers after the first scaled by ``quiet_layers`` (so a draft made of the
    first layer agrees often); ``shape``: sizes other than SHAPE's."""
    class_name, extra = FAMILY_CONFIGS[family]
    shape = {**SHAPE, **shape, **SPECIAL, "vocab_size": vocab, "num_hidden_layers": layers}
    build_checkpoint(Path(directory), class_name, extra, shape, seed=seed, quiet_layers=quiet_layers)
    copy_tokenizer(tokenizer_dir, directory)
    return Path(directory)


def first_layer_draft(target_dir: Path, directory: Path, *, vocab: int | None = None) -> Path:
    """A one-layer checkpoint of the target's first layer, embedding, final norm and LM head (same family, same
    tokenizer), its vocabulary padded or cut to ``vocab`` ids (the padding rows zero)."""
    import transformers

    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir)
    config = target.config
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    config.vocab_size = vocab or config.vocab_size
    draft = transformers.AutoModelForCausalLM.from_config(config)
    state = target.state_dict()
    with torch.no_grad():
        for name, param in draft.state_dict().items():
            if name in state:
                source = state[name]
                param.zero_()
                rows = min(param.shape[0], source.shape[0])
                param[:rows] = source[:rows]
    draft.generation_config.eos_token_id = None
    draft.save_pretrained(directory)
    copy_tokenizer(target_dir, directory)
    return Path(directory)
