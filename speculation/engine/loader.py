"""Load a Hugging Face Llama-format directory (config.json + *.safetensors) into our Transformer."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from speculation.engine.errors import ModelFormatError
from speculation.engine.model import ModelArgs, Transformer

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral"})


def args_from_config(config: dict) -> ModelArgs:
    if config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ModelFormatError(f"model_type {config.get('model_type')!r} is not supported (Llama-style only)")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ModelFormatError(f"rope type {rope.get('rope_type')!r} is not supported")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ModelFormatError("attention/MLP biases are not supported")
    n_heads = config["num_attention_heads"]
    dim = config["hidden_size"]
    if config.get("head_dim", dim // n_heads) != dim // n_heads:
        raise ModelFormatError("head_dim must equal hidden_size / num_attention_heads")
    return ModelArgs(
        vocab_size=config["vocab_size"],
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        intermediate_size=config["intermediate_size"],
        max_positions=config["max_position_embeddings"],
        norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
    )


def _read_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"no *.safetensors file in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensors[key] = handle.get_tensor(key)
    return tensors


def _convert(hf: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    def take(name: str) -> torch.Tensor:
        try:
            return hf[name]
        except KeyError as exc:
            raise ModelFormatError(f"checkpoint lacks {name}") from exc

    ours = {"tok_embeddings.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    ours["output.weight"] = ours["tok_embeddings.weight"] if args.tie_embeddings else take("lm_head.weight")
    for i in range(args.n_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        ours[dst + "attention.wqkv.weight"] = torch.cat(
            [take(src + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
        )
        ours[dst + "attention.wo.weight"] = take(src + "self_attn.o_proj.weight")
        ours[dst + "feed_forward.w13.weight"] = torch.cat([take(src + f"mlp.{n}_proj.weight") for n in ("gate", "up")])
        ours[dst + "feed_forward.w2.weight"] = take(src + "mlp.down_proj.weight")
        ours[dst + "attention_norm.weight"] = take(src + "input_layernorm.weight")
        ours[dst + "ffn_norm.weight"] = take(src + "post_attention_layernorm.weight")
    return ours


def load_causal_lm(
    directory: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    max_len: int | None = None,
) -> Transformer:
    """Load a Llama checkpoint directory; the KV cache is allocated for ``max_len`` positions (default: all)."""
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelFormatError(f"{directory} has no config.json")
    args = args_from_config(json.loads(config_path.read_text()))
    with torch.device("meta"):
        model = Transformer(args)
    state = {k: v.to(dtype) for k, v in _convert(_read_tensors(directory), args).items()}
    model.load_state_dict(state, assign=True, strict=True)
    model = model.to(device=device).eval().requires_grad_(False)
    if model.output.weight.device.type == "cpu":
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
