"""EAGLE-3 draft head (Li et al. 2025, arXiv 2503.01840) in the layout vLLM and SGLang load (`method: "eagle3"`).

The forward is vLLM 0.32's `model_executor/models/llama_eagle3.py`, operation for operation:

    h      = fc([a_1, ..., a_n])                     # true positions: the target's aux states (n * H -> H)
           | g_prev                                  # drafted positions: the head's own previous output
    x      = [input_layernorm(embed(x_{i+1})), hidden_norm(h)]          # 2H wide, into q/k/v
    r      = h (or hidden_norm(h) with norm_before_residual)
    r      = r + attn(x);   g = r + mlp(post_attention_layernorm(r))    # g: pre-norm, fed back
    logits = lm_head(norm(g))                        # the head's own norm; lm_head the target's unless it has one

a_j is the target's residual stream entering layer `eagle_aux_hidden_state_layer_ids[j]` (the output of the layer
before it; ACE's feature taps, so ``feature_layers`` are the ids minus one). A head with a reduced draft vocabulary
(`draft_vocab_size` < vocab_size) maps draft id d to target id d + d2t[d]; the rest of the vocabulary gets -inf.

Saved as the EAGLE authors' checkpoint (`LlamaForCausalLMEagle3`, tensors `fc.*`, `midlayer.*`, `norm.*`,
no embedding, no lm_head when it is the target's), which vLLM and SGLang both load; the speculators format
(`speculators_model_type: "eagle3"`, `layers.0.*`) loads here too (engine/eagle_format.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from speculation.engine.eagle import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    EagleConfig,
    EagleHeadError,
    _NoCache,
    llama_layer_keys,
)
from speculation.engine.eagle_format import ACE_SECTION, EAGLE3_ARCHITECTURE, FORMAT_EAGLE3
from speculation.engine.model import Block, KVCache, RMSNorm
from speculation.engine.rope import rope_tables

# ACE's parameter names -> the checkpoint's (q/k/v and gate/up are fused here, split there).
_LAYER = {
    "layer.attention.wo.weight": "self_attn.o_proj.weight",
    "layer.feed_forward.w2.weight": "mlp.down_proj.weight",
    "layer.ffn_norm.weight": "post_attention_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
}
_FUSED = {
    "layer.attention.wqkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "layer.feed_forward.w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_TOP = {"fuse.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head": "lm_head.weight", "d2t": "d2t"}
LAYER_PREFIXES = ("midlayer.", "layers.0.")  # the EAGLE authors' and the speculators' name for the one layer


class Eagle3Head(nn.Module):
    """fc over the target's aux states, one decoder layer over [embedding, feature], the head's own final norm."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        if not config.eagle3:
            raise EagleHeadError("Eagle3Head needs an EAGLE-3 config (eagle3=True)")
        self.config = config
        h = config.hidden_size
        self.args = config.model_args()
        self.fuse = nn.Linear(len(config.feature_layers) * h, h, bias=False)  # vLLM's fc
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layer = Block(self.args)
        self.layer.attention_norm = nn.Identity()  # the inputs are normed above, before the concatenation
        a = self.args
        self.layer.attention.wqkv = nn.Linear(2 * h, (a.n_heads + 2 * a.n_kv_heads) * a.head_dim, bias=False)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        draft_vocab = config.draft_vocab_size or config.vocab_size
        # None: the target's LM head (ACE's own heads); a head trained elsewhere may carry its own
        self.lm_head: nn.Parameter | None = None
        d2t = None if draft_vocab == config.vocab_size else torch.zeros(draft_vocab, dtype=torch.long)
        self.register_buffer("d2t", d2t)  # draft id d -> target id d + d2t[d]
        cos, sin = rope_tables(self.args, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_positions, D]
        self.register_buffer("rope_sin", sin, persistent=False)
        self.kv_cache: KVCache | None = None
        self._no_cache = _NoCache()

    def setup_cache(self, max_len: int) -> None:
        param, a = self.fuse.weight, self.args
        self.kv_cache = KVCache(a.n_kv_heads, max_len, a.head_dim, param.dtype, param.device)

    def fuse_true(self, features: Tensor) -> Tensor:
        """The target's [aux_1, ..., aux_n, final-norm] features [.., (n + 1) H] -> fc's H-wide input to the layer."""
        return self.fuse(features[..., : self.fuse.in_features])

    def feature_of(self, g: Tensor) -> Tensor:
        """What the head predicts of the target's final-norm feature (its output through its own final norm)."""
        return self.norm(g)

    def logits(self, g: Tensor, lm_head_weight: Tensor) -> Tensor:
        """Draft logits [.., V] over the target's vocabulary; lm_head_weight: the target's (used unless the head has
        its own)."""
        weight = self.lm_head if self.lm_head is not None else lm_head_weight
        logits = self.norm(g) @ weight.T  # [.., draft V]
        if self.d2t is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.config.vocab_size), float("-inf"))
        full[..., torch.arange(logits.shape[-1], device=logits.device) + self.d2t] = logits
        return full

    def forward(
        self,
        features: Tensor,  # [B, T, H] the head's own g, or [B, T, (n + 1) * H] the target's true features
        embeds: Tensor,  # [B, T, H]: embeddings of x_{i+1}
        start: int = 0,
        use_cache: bool = False,
        *,
        positions: Tensor | None = None,  # [T]: RoPE positions (a draft tree's); default start..start+T-1
        mask: Tensor | None = None,  # [T, start + T] bool; default causal
    ) -> Tensor:  # [B, T, H]: g, the layer's pre-norm output
        t = features.shape[1]
        attention = self.layer.attention
        if use_cache:
            if self.kv_cache is None:
                raise EagleHeadError("call setup_cache() before drafting")
            attention.cache = self.kv_cache
        else:
            attention.cache, start = self._no_cache, 0
        if mask is None and t > 1:
            mask = torch.ones(t, start + t, dtype=torch.bool, device=features.device).tril(diagonal=start)
        h = features if features.shape[-1] == self.config.hidden_size else self.fuse_true(features)
        normed = self.hidden_norm(h)
        residual = normed if self.config.norm_before_residual else h
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, T, 2H]
        if positions is None:
            cos, sin = self.rope_cos[start : start + t], self.rope_sin[start : start + t]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return self.layer.run(residual, lambda _: attention(x, start, cos, sin, mask))

    def init_weights(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Seeded: normal(0, std), norms at 1, fc passing the deepest aux state through (the EAGLE-1 start)."""
        h = self.config.hidden_size
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(torch.ones_like(param) if name.endswith("norm.weight") else
                            torch.randn(param.shape, generator=generator) * std)  # fmt: skip
            self.fuse.weight[:, -h:] += torch.eye(h)
            self.layer.attention.wo.weight.mul_(1 / math.sqrt(2))
            self.layer.feed_forward.w2.weight.mul_(1 / math.sqrt(2))

    # --- save / load ---------------------------------------------------------------------------------------

    def hf_config(self, extra: dict | None = None) -> dict:
        """config.json: vLLM's and SGLang's keys (the aux layers in each one's numbering: eagle_format.aux_layer_ids;
        no draft_vocab_size when the head uses the target's LM head, which is how SGLang knows to load it)."""
        c = self.config
        config = {
            "architectures": [EAGLE3_ARCHITECTURE],
            **llama_layer_keys(c),
            "target_hidden_size": c.hidden_size,
            "norm_before_residual": c.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": aux_ids(c),  # vLLM: the inputs of these layers
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.feature_layers), "use_aux_hidden_state": True},
            ACE_SECTION: {**asdict(c), "format": FORMAT_EAGLE3, **(extra or {})},
        }
        if self.lm_head is not None:
            config["draft_vocab_size"] = c.draft_vocab_size or c.vocab_size
        return config

    def save(self, directory: Path, *, extra: dict | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CONFIG_FILE).write_text(json.dumps(self.hf_config(extra), indent=2) + "\n")
        save_file(to_checkpoint(self), str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return directory

    @classmethod
    def from_checkpoint(cls, config: EagleConfig, directory: Path) -> Eagle3Head:
        head = cls(config)
        try:
            tensors = load_file(str(Path(directory) / WEIGHTS_FILE))
            from_checkpoint(head, tensors)
        except (RuntimeError, OSError, KeyError, ValueError) as exc:
            raise EagleHeadError(f"cannot load the EAGLE-3 head's weights from {directory}: {exc}") from exc
        return head


def aux_ids(config: EagleConfig) -> list[int]:
    """vLLM's eagle_aux_hidden_state_layer_ids of a head: the residual stream entering layer i = ACE's tap i - 1."""
    return [i + 1 for i in config.feature_layers]


def to_checkpoint(head: Eagle3Head) -> dict[str, Tensor]:
    """The head's tensors under the EAGLE authors' names (float32, q/k/v and gate/up split)."""
    state = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in head.state_dict().items()}
    out = {hf: state[ours] for ours, hf in _TOP.items() if ours in state and ours != "d2t"}
    if head.d2t is not None:
        out["d2t"] = head.d2t.detach().cpu()
    for ours, hf in _LAYER.items():
        out[f"midlayer.{hf}"] = state[ours]
    a = head.args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    for ours, parts in _FUSED.items():
        sizes = [q, kv, kv] if len(parts) == 3 else [a.intermediate_size] * 2
        for hf, piece in zip(parts, state[ours].split(sizes), strict=True):
            out[f"midlayer.{hf}"] = piece.contiguous()
    return out


def from_checkpoint(head: Eagle3Head, tensors: dict[str, Tensor]) -> None:
    """Load a checkpoint's tensors (midlayer.* or layers.0.*; embed_tokens and t2d are not used: the target's
    embedding is shared, as vLLM shares it when the head has none or an identical one)."""
    prefix = next((p for p in LAYER_PREFIXES if f"{p}hidden_norm.weight" in tensors), None)
    if prefix is None:
        raise KeyError("no midlayer.hidden_norm.weight (nor layers.0.hidden_norm.weight): not an EAGLE-3 head")
    state = {ours: tensors[hf] for ours, hf in _TOP.items() if hf in tensors and ours not in ("lm_head", "d2t")}
    state.update({ours: tensors[prefix + hf] for ours, hf in _LAYER.items()})
    for ours, parts in _FUSED.items():
        state[ours] = torch.cat([tensors[prefix + hf] for hf in parts])
    if "lm_head.weight" in tensors:  # its own LM head (over its draft vocabulary)
        head.lm_head = nn.Parameter(torch.empty_like(tensors["lm_head.weight"]), requires_grad=False)
        state["lm_head"] = tensors["lm_head.weight"]
    if head.d2t is not None:
        if "d2t" not in tensors or head.lm_head is None:
            raise KeyError(f"draft_vocab_size {head.d2t.numel()} needs its d2t map and its lm_head")
        state["d2t"] = tensors["d2t"].long()
    head.load_state_dict(state)
