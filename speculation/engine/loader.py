"""Load a Hugging Face checkpoint directory (config.json + safetensors) of a supported family into our Transformer;
another dense decoder-only causal LM transformers implements loads as transformers' model (engine/generic.py).

The family (engine/families.py) says how the checkpoint names its tensors; a sharded checkpoint
(model.safetensors.index.json) is read shard by shard, each tensor converted to the model's dtype as it is read,
and split projections are fused as soon as their parts are in, so the peak is about one copy of the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from speculation.engine.errors import ModelFormatError
from speculation.engine.families import (
    SUPPORTED_MODEL_TYPES,
    Family,
    ModelArgs,
    args_from_config,
    family_of,
    implementation,
)
from speculation.engine.generic import GenericCausalLM, load_generic
from speculation.engine.model import Transformer

__all__ = ["SUPPORTED_MODEL_TYPES", "args_from_config", "load_causal_lm"]

INDEX_FILE = "model.safetensors.index.json"
HALF_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the index's shards when there is an index, else every *.safetensors."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as exc:
            raise ModelFormatError(f"{INDEX_FILE} has no weight_map: {exc}") from exc
        missing = [n for n in names if not (directory / n).is_file()]
        if missing:
            raise ModelFormatError(f"{INDEX_FILE} names shards that are not there: {', '.join(missing[:3])}")
        return [directory / n for n in names]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"no *.safetensors file in {directory}")
    return files


def _layer_parts(family: Family, args: ModelArgs, i: int) -> dict[str, list[str]]:
    """Our tensor name -> the checkpoint's names concatenated into it (one name: a rename), for layer i."""
    src, dst = f"model.layers.{i}.", f"layers.{i}."
    parts = {
        dst + "attention.wqkv.weight": [f"{src}self_attn.{n}.weight" for n in family.qkv],
        dst + "attention.wo.weight": [f"{src}self_attn.o_proj.weight"],
        dst + "feed_forward.w13.weight": [f"{src}mlp.{n}.weight" for n in family.gate_up],
        dst + "feed_forward.w2.weight": [f"{src}mlp.down_proj.weight"],
    }
    if args.qkv_bias:
        parts[dst + "attention.wqkv.bias"] = [f"{src}self_attn.{n}.bias" for n in family.qkv]
    if args.o_bias:
        parts[dst + "attention.wo.bias"] = [f"{src}self_attn.o_proj.bias"]
    if args.qk_norm:
        parts[dst + "attention.q_norm.weight"] = [f"{src}self_attn.q_norm.weight"]
        parts[dst + "attention.k_norm.weight"] = [f"{src}self_attn.k_norm.weight"]
    for ours, theirs in family.norms:
        parts[f"{dst}{ours}.weight"] = [f"{src}{theirs}.weight"]
    return parts


def tensor_plan(family: Family, args: ModelArgs) -> dict[str, list[str]]:
    """Every tensor of our model and the checkpoint tensors it is made of."""
    plan = {"tok_embeddings.weight": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not args.tie_embeddings:
        plan["output.weight"] = ["lm_head.weight"]
    for i in range(args.n_layers):
        plan.update(_layer_parts(family, args, i))
    return plan


def read_state(
    directory: Path, family: Family, args: ModelArgs, *, device: torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Our state dict, read shard by shard: each tensor goes to ``device`` in ``dtype`` as it is read, and a fused
    tensor is built (and its parts dropped) once all its parts are in."""
    plan = tensor_plan(family, args)
    wanted = {name: ours for ours, names in plan.items() for name in names}
    pending: dict[str, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                ours = wanted.get(key)
                if ours is None:
                    continue
                pending[key] = handle.get_tensor(key).to(device=device, dtype=dtype)
                names = plan[ours]
                if all(n in pending for n in names):
                    parts = [pending.pop(n) for n in names]
                    state[ours] = parts[0] if len(parts) == 1 else torch.cat(parts)
    missing = [name for ours, names in plan.items() if ours not in state for name in names if name not in pending]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelFormatError(f"checkpoint lacks {missing[0]}{more}")
    return state


def default_dtype(config: dict, device: torch.device) -> torch.dtype:
    """On CUDA the checkpoint's own bf16 / fp16, else bf16 (half the memory, the tensor cores); float32 elsewhere."""
    if device.type == "cuda":
        return HALF_DTYPES.get(str(config.get("dtype") or config.get("torch_dtype")), torch.bfloat16)
    return torch.float32


def load_causal_lm(
    directory: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    max_len: int | None = None,
) -> Transformer | GenericCausalLM:
    """Load a checkpoint directory of a supported family; the KV cache holds ``max_len`` positions (default: all).
    dtype None: the checkpoint's half precision on CUDA, float32 on the CPU. The model's ``implementation`` says
    whether ACE's own layer runs it ("native") or transformers' model ("generic": exact, slower, batch one)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{directory} has no config.json")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{config_path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelFormatError(f"{config_path} is not a JSON object")
    device = torch.device(device)
    dtype = dtype or default_dtype(config, device)
    if implementation(config) == "generic":
        return load_generic(directory, config, device=device, dtype=dtype, max_len=max_len)
    family = family_of(config)
    args = args_from_config(config)
    with torch.device("meta"):
        model = Transformer(args)
    state = read_state(directory, family, args, device=device, dtype=dtype)
    try:
        result = model.load_state_dict(state, assign=True, strict=False)
    except RuntimeError as exc:
        raise ModelFormatError(f"{directory}: the weights do not fit config.json: {str(exc)[:300]}") from exc
    unfilled = set(result.missing_keys) - ({"output.weight"} if args.tie_embeddings else set())
    if unfilled or result.unexpected_keys:
        raise ModelFormatError(f"{directory}: the weights do not fit the model: {sorted(unfilled)[:3]}")
    if args.tie_embeddings:  # one tensor, not a copy (a large vocabulary's embedding is a large part of a model)
        model.output.weight = model.tok_embeddings.weight
    model = model.eval().requires_grad_(False)
    if device.type == "cpu":
        column_major_linears(model)
    model.setup_cache(max_len)
    return model


def column_major_linears(model: nn.Module) -> None:
    """Store every Linear's weight [out, in] column-major (an [in, out] buffer seen transposed), in place.

    Same values, same memory; only the order in memory changes. On CPU, x @ W.T then reads W row by row: on the
    a 2-core Xeon one token through the demo target's projections takes 30-45 % less time (12 vs 23 us for
    256 -> 768, 57 vs 98 us for the 256 -> 2048 head). A weight tied to
    the embedding keeps the embedding's layout (a lookup reads rows)."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if isinstance(module, nn.Linear) and id(module.weight) not in tied:
            weight = module.weight
            module.weight = nn.Parameter(weight.detach().t().contiguous().t(), requires_grad=weight.requires_grad)
