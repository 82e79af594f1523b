"""The dense decoder-only model families the engine runs, each described by data over one implementation (model.py).

A ``Family`` says what differs between Llama, Mistral, Qwen 2/3, Gemma 2/3 and Phi-3 checkpoints: tensor names
(fused or split projections, the norm names), biases, q/k norms, Gemma's ``1 + w`` norms, embedding scale and extra
post-attention / post-feedforward norms, which layers use a sliding window. ``args_from_config`` reads a Hugging Face
config.json into ``ModelArgs`` (rope scaling, soft-capping, head_dim, query_pre_attn_scalar come from the config) and
refuses what the engine cannot run exactly (mixture-of-experts, encoder-decoder, multimodal, quantized) with the
reason. A dense decoder-only model of another type that transformers implements runs through transformers' own model
(engine/generic.py): ``implementation`` says which. Standard library only: the web process checks a config at
registration with the same rules.
"""

from __future__ import annotations

import ast
import importlib.util
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from speculation.engine.errors import ModelFormatError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# Config keys that mark a mixture-of-experts model (Mixtral, Qwen2-MoE / Qwen3-MoE, DeepSeek, ...).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
MULTIMODAL_KEYS = ("vision_config", "audio_config", "text_config", "vision_tower", "image_token_index")
# Model types (substrings) and layer types whose state is recurrent (state-space, linear attention, convolution): no
# KV cache to cut back after a rejection. The loader checks the cache itself too (engine/generic.py).
RECURRENT_TYPES = ("mamba", "rwkv", "xlstm", "recurrent_gemma", "jamba", "zamba", "hybrid", "nemotron_h", "lfm2")
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class Rope:
    """Rotary scaling as transformers' rope_parameters (theta aside): default, linear, dynamic, llama3 or yarn.

    Dynamic NTK changes frequencies only past max_position_embeddings, where the engine's cache ends: within it,
    it is the default rotation."""

    type: str = "default"
    factor: float = 1.0
    original_max_positions: int = 0  # llama3 and yarn: the pre-training context
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn: cos and sin scaled by it (None: from factor and mscale)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelArgs:
    """Shape and variant of one decoder-only model; the defaults are Llama's."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate_size: int
    max_positions: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    head_dim: int = 0  # 0: dim // n_heads
    rotary_dim: int = 0  # 0: head_dim (Phi-3's partial rotary rotates the first rotary_dim of each head)
    rope: Rope = field(default_factory=Rope)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own (default) rotation
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen 3, Gemma 3: RMSNorm over each head of q and k before the rotation
    norm_offset: float = 0.0  # Gemma: norms scale by (offset + weight), in float32
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the feed-forward too
    embed_scale: float = 1.0  # Gemma: embeddings times sqrt(dim)
    activation: str = "silu"  # or "gelu_tanh"
    attn_scale: float = 0.0  # 0: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    windows: tuple[int | None, ...] = ()  # per layer: a sliding window (keys within it) or None (all); () none

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if not self.rotary_dim:
            object.__setattr__(self, "rotary_dim", self.head_dim)

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None


@dataclass(frozen=True)
class Family:
    """How one family's checkpoints name and shape what ModelArgs describes."""

    model_types: tuple[str, ...]
    qkv: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")  # under self_attn, concatenated in this order
    gate_up: tuple[str, ...] = ("gate_proj", "up_proj")  # under mlp
    # our norm name -> the checkpoint's, per layer
    norms: tuple[tuple[str, str], ...] = (
        ("attention_norm", "input_layernorm"),
        ("ffn_norm", "post_attention_layernorm"),
    )
    qkv_bias: bool = False  # always (Qwen 2); otherwise the config's attention_bias
    qk_norm: bool = False
    gemma: bool = False  # 1 + w norms, sqrt(dim) embedding scale, query_pre_attn_scalar, soft-capping
    windows: str = "none"  # which layers slide: none, all, qwen (use_sliding_window, from max_window_layers), pattern
    window_pattern: int = 0  # "pattern": layer i slides unless (i + 1) % pattern == 0 (when layer_types is absent)
    default_activation: str = "silu"


_GEMMA_NORMS = (
    ("attention_norm", "input_layernorm"),
    ("attention_out_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("ffn_out_norm", "post_feedforward_layernorm"),
)
FAMILIES = {
    "llama": Family(("llama",)),
    "mistral": Family(("mistral",), windows="all"),
    "qwen2": Family(("qwen2",), qkv_bias=True, windows="qwen"),
    "qwen3": Family(("qwen3",), qk_norm=True, windows="qwen"),
    "gemma2": Family(
        ("gemma2",),
        norms=_GEMMA_NORMS,
        gemma=True,
        windows="pattern",
        window_pattern=2,
        default_activation="gelu_pytorch_tanh",
    ),  # fmt: skip
    "gemma3": Family(
        ("gemma3_text",),
        norms=_GEMMA_NORMS,
        qk_norm=True,
        gemma=True,
        windows="pattern",
        window_pattern=6,
        default_activation="gelu_pytorch_tanh",
    ),  # fmt: skip
    "phi3": Family(("phi3",), qkv=("qkv_proj",), gate_up=("gate_up_proj",), windows="all"),
}
_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}
SUPPORTED_MODEL_TYPES = tuple(sorted(_BY_MODEL_TYPE))


def refusal(config: dict) -> str | None:
    """Why the engine cannot run this config.json exactly (None: it can): the reason, as a user should read it."""
    model_type = config.get("model_type")
    if config.get("quantization_config"):
        method = (config["quantization_config"] or {}).get("quant_method", "unknown method")
        return f"quantized checkpoints are not supported (quantization_config: {method}); use the unquantized weights"
    if config.get("is_encoder_decoder"):
        return f"encoder-decoder models are not supported (model_type {model_type!r})"
    if any(config.get(key) for key in MOE_KEYS) or "moe" in str(model_type).lower():
        return f"mixture-of-experts models are not supported (model_type {model_type!r})"
    if any(key in config for key in MULTIMODAL_KEYS):
        return f"multimodal models are not supported (model_type {model_type!r}); use the text model's checkpoint"
    if model_type in _BY_MODEL_TYPE:
        return None
    if model_type not in transformers_causal_lm_types():
        return (
            f"model_type {model_type!r} is not supported: neither a family ACE runs natively "
            f"({', '.join(SUPPORTED_MODEL_TYPES)}) nor a causal LM the installed transformers implements"
        )
    layer_types = config.get("layer_types") or ()
    if any(t in str(model_type) for t in RECURRENT_TYPES) or any(t not in ATTENTION_LAYER_TYPES for t in layer_types):
        return f"recurrent or hybrid models are not supported (model_type {model_type!r}): no KV cache to cut back"
    return None


def implementation_of(model_type: str | None) -> str:
    """ "native" (ACE's own layer, model.py) for a family it describes, else "generic" (transformers' model)."""
    return "native" if model_type in _BY_MODEL_TYPE else "generic"


def implementation(config: dict) -> str:
    """How the engine runs this config.json ("native" or "generic"); ModelFormatError naming why it cannot."""
    reason = refusal(config)
    if reason:
        raise ModelFormatError(reason)
    return implementation_of(config.get("model_type"))


@lru_cache(maxsize=1)
def transformers_causal_lm_types() -> frozenset[str]:
    """The model types the installed transformers implements as AutoModelForCausalLM, read from its source
    (modeling_auto's MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) without importing it: importing transformers' auto models
    imports torch, which the web process does not. Empty when transformers is not installed."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    source = Path(next(iter(spec.submodule_search_locations)), "models", "auto", "modeling_auto.py")
    try:
        tree = ast.parse(source.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return frozenset()
    for node in tree.body:
        names = [getattr(target, "id", None) for target in getattr(node, "targets", ())]
        if "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES" in names and isinstance(node.value, ast.Call) and node.value.args:
            try:
                return frozenset(str(pair[0]) for pair in ast.literal_eval(node.value.args[0]))
            except (ValueError, TypeError, IndexError):
                return frozenset()
    return frozenset()


def family_of(config: dict) -> Family:
    """The native family of a config.json; ModelFormatError when the engine cannot run it natively."""
    if implementation(config) != "native":
        raise ModelFormatError(
            f"model_type {config.get('model_type')!r} runs through transformers (generic), not ACE's own layer"
        )
    return _BY_MODEL_TYPE[config["model_type"]]


def _rope_parameters(config: dict) -> tuple[dict, dict | None]:
    """(the global rotation's parameters, the sliding layers' own or None), from either config layout."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if "full_attention" in params:  # Gemma 3 in transformers 5: one entry per layer type
        return params["full_attention"] or {}, params.get("sliding_attention")
    params = {"rope_theta": config.get("rope_theta", 10000.0), **params}
    local = config.get("rope_local_base_freq")
    return params, ({"rope_theta": local} if local else None)


def _rope(params: dict, config: dict) -> Rope:
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ROPE_TYPES:
        raise ModelFormatError(f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if kind == "default":
        return Rope()
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings") or config.get("original_max_position_embeddings") or 0
    if factor is None and kind == "yarn" and original:
        factor = config["max_position_embeddings"] / original
    if factor is None:
        raise ModelFormatError(f"rope type {kind!r} needs a factor")
    if kind in ("llama3", "yarn") and not original:
        raise ModelFormatError(f"rope type {kind!r} needs original_max_position_embeddings")
    return Rope(
        type=kind,
        factor=float(factor),
        original_max_positions=int(original),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def _windows(family: Family, config: dict, n_layers: int) -> tuple[int | None, ...]:
    window = config.get("sliding_window")
    if family.windows == "qwen" and not config.get("use_sliding_window"):
        window = None
    if not window or family.windows == "none":
        return ()
    types = config.get("layer_types")
    if types and family.windows != "all":
        sliding = [t == "sliding_attention" for t in types]
    elif family.windows == "qwen":
        sliding = [i >= config.get("max_window_layers", 0) for i in range(n_layers)]
    elif family.windows == "pattern":
        pattern = config.get("sliding_window_pattern") or config.get("_sliding_window_pattern") or family.window_pattern
        sliding = [bool((i + 1) % pattern) for i in range(n_layers)]
    else:
        sliding = [True] * n_layers
    windows = tuple(int(window) if s else None for s in sliding)
    return windows if any(windows) else ()


def args_from_config(config: dict) -> ModelArgs:
    """ModelArgs for a Hugging Face config.json of a supported family; ModelFormatError naming what is not."""
    family = family_of(config)
    try:
        n_heads, dim = int(config["num_attention_heads"]), int(config["hidden_size"])
        n_layers = int(config["num_hidden_layers"])
        head_dim = int(config.get("head_dim") or dim // n_heads)
        params, local = _rope_parameters(config)
        partial = float(params.get("partial_rotary_factor") or config.get("partial_rotary_factor") or 1.0)
        act_name = config.get("hidden_activation") or config.get("hidden_act") or family.default_activation
        if act_name not in ACTIVATIONS:
            raise ModelFormatError(f"activation {act_name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        if config.get("mlp_bias"):
            raise ModelFormatError("MLP biases are not supported")
        gemma = family.gemma
        return ModelArgs(
            vocab_size=int(config["vocab_size"]),
            dim=dim,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(config.get("num_key_value_heads") or n_heads),
            intermediate_size=int(config["intermediate_size"]),
            max_positions=int(config["max_position_embeddings"]),
            norm_eps=float(config.get("rms_norm_eps", 1e-6 if gemma else 1e-5)),
            rope_theta=float(params.get("rope_theta", 10000.0)),
            tie_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            rope=_rope(params, config),
            local_rope_theta=float(local["rope_theta"]) if local and local.get("rope_theta") else None,
            qkv_bias=family.qkv_bias or bool(config.get("attention_bias")),
            o_bias=not family.qkv_bias and bool(config.get("attention_bias")),
            qk_norm=family.qk_norm,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            embed_scale=math.sqrt(dim) if gemma else 1.0,
            activation=ACTIVATIONS[act_name],
            attn_scale=float(config.get("query_pre_attn_scalar") or head_dim) ** -0.5 if gemma else 0.0,
            attn_softcap=config.get("attn_logit_softcapping") if gemma else None,
            final_softcap=config.get("final_logit_softcapping") if gemma else None,
            windows=_windows(family, config, n_layers),
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ModelFormatError):
            raise
        raise ModelFormatError(f"config.json: {exc!r} is missing or malformed") from exc
