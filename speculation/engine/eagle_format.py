"""Which kind of EAGLE head a directory holds, from its config.json alone (torch-free: the web process reads it).

- format 1 (EAGLE-1): ACE's `ace_eagle` section without feature layers; vLLM's `method: "eagle"` layout.
- format 2: ACE's older multi-layer head (a `fuse` layer before EAGLE-1's `fc`); ACE's local path only.
- format 3 (EAGLE-3): the layout vLLM's `llama_eagle3.py` and SGLang's `LlamaForCausalLMEagle3` load: the
  architecture `LlamaForCausalLMEagle3` (the EAGLE authors' format, which ACE saves) or a speculators-format
  config (`speculators_model_type: "eagle3"`, the layer config under `transformer_layer_config`). Heads trained
  elsewhere (the published EAGLE-3 heads) are format 3 without an `ace_eagle` section.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

ACE_SECTION = "ace_eagle"
FORMAT_EAGLE1 = 1
FORMAT_MULTI_LAYER = 2
FORMAT_EAGLE3 = 3
FORMATS = (FORMAT_EAGLE1, FORMAT_MULTI_LAYER, FORMAT_EAGLE3)
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_EAGLE3 = "eagle3"
# The fingerprint reads the target's config and a fixed sample of its weight bytes: constant time for any size.
_FINGERPRINT_SAMPLES = 16
_FINGERPRINT_CHUNK = 1 << 16


def is_eagle3_config(config: dict[str, Any]) -> bool:
    """An EAGLE-3 head's config.json: the EAGLE authors' architecture name or the speculators format."""
    architectures = config.get("architectures") or []
    named = any(isinstance(a, str) and (a.endswith("Eagle3") or a.startswith("Eagle3")) for a in architectures)
    return named or config.get("speculators_model_type") == SPECULATORS_EAGLE3


def is_head_config(config: dict[str, Any]) -> bool:
    """Whether config.json describes an EAGLE head (ACE's, of any format, or an EAGLE-3 head from elsewhere)."""
    return isinstance(config.get(ACE_SECTION), dict) or is_eagle3_config(config)


def head_format(config: dict[str, Any]) -> int:
    """The head's format (FORMATS) from its config.json; 1 for anything that is neither ACE's nor EAGLE-3."""
    meta = config.get(ACE_SECTION)
    if isinstance(meta, dict) and meta.get("format"):
        return int(meta["format"])
    return FORMAT_EAGLE3 if is_eagle3_config(config) else FORMAT_EAGLE1


def layer_config(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder layer's config plus the EAGLE-3 keys vLLM reads, whichever format config.json is in
    (speculators: the layer config nested, EAGLE-3's keys at the top; vLLM's algos.update_eagle3)."""
    if config.get("speculators_model_type") != SPECULATORS_EAGLE3:
        return dict(config)
    merged = dict(config.get("transformer_layer_config") or {})
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_fc",
                "fc_norm", "norm_output"):  # fmt: skip
        if config.get(key) is not None:
            merged[key] = config[key]
    merged["norm_before_residual"] = config.get("norm_before_residual", True)  # speculators' default
    return merged


def eagle3_problems(config: dict[str, Any]) -> list[str]:
    """What in an EAGLE-3 head's config.json ACE's engine cannot run exactly (empty: it can). vLLM runs more
    variants (norm_before_fc, fc_norm, norm_output, Qwen3 heads); ACE replays and serves Llama-layout heads."""
    c = layer_config(config)
    problems = [f"{key} set" for key in ("norm_before_fc", "fc_norm", "norm_output", "attention_bias") if c.get(key)]
    if c.get("model_type", "llama") != "llama":
        problems.append(f"model_type {c.get('model_type')!r} (Llama-layout heads only)")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) not in ("default", None):
        problems.append(f"rope scaling {rope.get('rope_type', rope.get('type'))!r}")
    if c.get("num_hidden_layers", 1) != 1:
        problems.append(f"{c.get('num_hidden_layers')} decoder layers (one only)")
    if c.get("target_hidden_size") not in (None, c.get("hidden_size")):
        problems.append("a target_hidden_size other than its hidden_size")
    ids = aux_layer_ids(config)
    if ids is not None and any(i < 1 for i in ids):
        problems.append(f"aux layer ids {ids} include 0 (the embedding, which ACE's target does not tap)")
    return problems


def aux_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """The target layers an EAGLE-3 head reads, as vLLM numbers them (i: the residual stream entering layer i, so
    the output of layer i - 1); None when config.json leaves them to the server's default.

    The two servers number them differently: vLLM reads the top-level `eagle_aux_hidden_state_layer_ids` (first)
    as layer inputs; SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` as layer outputs (it adds one,
    `set_eagle3_layers_to_capture`). ACE writes both, each in its reader's numbering."""
    merged = layer_config(config)
    if merged.get("eagle_aux_hidden_state_layer_ids"):
        return [int(i) for i in merged["eagle_aux_hidden_state_layer_ids"]]
    eagle_config = merged.get("eagle_config") if isinstance(merged.get("eagle_config"), dict) else {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    return [int(i) + 1 for i in ids] if ids else None


def default_aux_layer_ids(n_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 layers for a target of n_layers (SupportsEagle3.get_eagle3_default_aux_hidden_state_
    layers): (2, n // 2, n - 3)."""
    return [2, n_layers // 2, n_layers - 3]


def read_config(directory: str | Path) -> dict[str, Any] | None:
    """config.json of a directory, or None when it is missing or unreadable here (it may lie on a server only)."""
    try:
        config = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def target_fingerprint(target_dir: Path) -> str:
    """sha256 over the target's shape config, its safetensors headers and a fixed sample of its weight bytes (what
    a head's `target_fingerprint` names; torch-free, so the web process checks a head against a target too)."""
    target_dir = Path(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings")  # fmt: skip
    digest = hashlib.sha256(json.dumps({k: config.get(k) for k in keys}, sort_keys=True).encode())
    files = sorted(target_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{target_dir} holds no *.safetensors weights")
    for file in files:
        size = file.stat().st_size
        with file.open("rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            digest.update(fh.read(header_len))
            for i in range(_FINGERPRINT_SAMPLES):
                fh.seek(8 + header_len + (size - 8 - header_len) * i // _FINGERPRINT_SAMPLES)
                digest.update(fh.read(_FINGERPRINT_CHUNK))
    return digest.hexdigest()[:32]
