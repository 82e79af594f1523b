"""EAGLE-1 draft head (Li et al., 2024, arXiv 2401.15077): drafting in the target's feature space.

The head reads, at each position i, the target's last hidden feature f_i (after the final norm) and the
embedding of the next token x_{i+1}, and predicts the next feature f_{i+1}:

    g_{i+1} = layer(fc([embed(x_{i+1}), f_i]))          # one Llama decoder layer, input norm = identity

The target's own LM head turns g_{i+1} into draft logits for x_{i+2}. Drafting K tokens is K steps of the
head in feature space, each feeding its own predicted feature back in. The weights follow vLLM's EAGLE-1
Llama layout (`fc.weight`, `layers.0.*`, no embedding and no LM head: both are the target's), so the saved
directory also runs natively in vLLM with `method: "eagle"`.

Saved as a small Hugging Face-style directory: config.json (a one-layer Llama config plus `ace_eagle`,
naming the target it was trained for and that target's fingerprint) and model.safetensors.

Multi-layer features (EAGLE-3, Li et al. 2025, arXiv 2503.01840): a head with ``feature_layers`` reads, for
the target's true positions, the outputs of those target layers and the final-norm feature concatenated
([low, mid, high], (n + 1) * H wide), which a linear layer ``fuse`` maps to H before ``fc``; drafted positions
feed the head's own predicted feature (H wide) as before, so it is trained with its own predictions as inputs
too (training-time test, speculation.offline.eagle.train). Such a head is saved as format 2 (format 1, EAGLE-1,
still loads unchanged); its `fuse` is ACE's own layout, not vLLM's EAGLE-3 one, so it runs on ACE's local path.
Multi-layer heads ACE trains now are format 3 (``eagle3=True``): vLLM's EAGLE-3 layout, engine/eagle3.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from speculation.engine.eagle_format import (
    ACE_SECTION,
    FORMAT_EAGLE1,
    FORMAT_EAGLE3,
    FORMAT_MULTI_LAYER,
    FORMATS,
    aux_layer_ids,
    default_aux_layer_ids,
    eagle3_problems,
    head_format,
    layer_config,
)
from speculation.engine.eagle_format import target_fingerprint as _target_fingerprint
from speculation.engine.errors import SpecDecodeError, VocabMismatchError
from speculation.engine.model import Block, KVCache, ModelArgs, Transformer
from speculation.engine.proposers import Proposal
from speculation.engine.rope import rope_tables
from speculation.engine.sampling import SamplingParams, probs_from_logits, sample
from speculation.engine.tree import TreeShape, expand_eagle_tree

FORMAT_VERSION = FORMAT_EAGLE1  # EAGLE-1: vLLM's `method: "eagle"` layout (format 2: ACE's local path only)
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class EagleHeadError(SpecDecodeError):
    """An EAGLE head directory is malformed, or was trained for another target."""


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    target_name: str = ""
    target_fingerprint: str = ""
    # target layers whose outputs join the final-norm feature (EAGLE-3); () reads the final-norm feature only
    feature_layers: tuple[int, ...] = ()
    # vLLM's EAGLE-3 layout (engine/eagle3.py): the aux states only (not the final-norm feature), the head's own norm
    eagle3: bool = False
    norm_before_residual: bool = False  # EAGLE-3: the residual is the normed input feature (speculators' default)
    draft_vocab_size: int = 0  # EAGLE-3: a reduced draft vocabulary with its d2t map; 0: the target's

    @property
    def feature_width(self) -> int:
        """Width of a true target feature the head reads: (len(feature_layers) + 1) * hidden_size."""
        return (len(self.feature_layers) + 1) * self.hidden_size

    @property
    def format(self) -> int:
        if self.eagle3:
            return FORMAT_EAGLE3
        return FORMAT_MULTI_LAYER if self.feature_layers else FORMAT_VERSION

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def model_args(self) -> ModelArgs:
        return ModelArgs(
            vocab_size=self.vocab_size,
            dim=self.hidden_size,
            n_layers=1,
            n_heads=self.num_attention_heads,
            n_kv_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            max_positions=self.max_position_embeddings,
            norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
        )

    @classmethod
    def for_target(
        cls,
        target_dir: Path,
        *,
        target_name: str = "",
        intermediate_size: int | None = None,
        multi_layer: bool = False,
    ):
        """A head shaped for the target in target_dir (HF Llama config.json); multi_layer: an EAGLE-3 head (vLLM's
        layout) reading vLLM's default aux layers (an EAGLE-1 head when the target has fewer than 4 layers)."""
        config = json.loads((Path(target_dir) / CONFIG_FILE).read_text())
        heads = config["num_attention_heads"]
        eagle3 = multi_layer and config["num_hidden_layers"] >= 4
        taps = tuple(i - 1 for i in default_aux_layer_ids(config["num_hidden_layers"])) if eagle3 else ()
        return cls(
            feature_layers=taps,
            eagle3=eagle3,
            hidden_size=config["hidden_size"],
            intermediate_size=intermediate_size or config["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            vocab_size=config["vocab_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta", 10000.0),
            max_position_embeddings=config.get("max_position_embeddings", 2048),
            target_name=target_name or default_target_name(target_dir),
            target_fingerprint=target_fingerprint(target_dir),
        )


def default_feature_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low and mid layers for a target of n_layers (the high one is the final-norm feature): the outputs
    of layers n/4 - 1 and n/2 - 1 (8 layers: 1 and 3); () when the target has fewer than 4 layers."""
    if n_layers < 4:
        return ()
    return (n_layers // 4 - 1, n_layers // 2 - 1)


def default_target_name(target_dir: Path) -> str:
    """The directory's last two parts ("demo-v3/target"): model directories are often just "target"."""
    path = Path(target_dir).resolve()
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def target_fingerprint(target_dir: Path) -> str:
    """eagle_format.target_fingerprint; EagleHeadError when the directory holds no weights."""
    try:
        return _target_fingerprint(target_dir)
    except FileNotFoundError as exc:
        raise EagleHeadError(str(exc)) from exc


# --- the head --------------------------------------------------------------------------------------------------


class _NoCache(nn.Module):
    """Stands in for the KV cache while training: the whole (batched) sequence attends to itself."""

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return k, v


# Our layer names -> vLLM's EAGLE-1 Llama names; fused tensors split in order.
_FUSED = {
    "layers.0.attention.wqkv.weight": ("q_proj", "k_proj", "v_proj"),
    "layers.0.feed_forward.w13.weight": ("gate_proj", "up_proj"),
}
_RENAMED = {
    "fc.weight": "fc.weight",
    "fuse.weight": "fuse.weight",  # format 2 only
    "layers.0.attention.wo.weight": "layers.0.self_attn.o_proj.weight",
    "layers.0.feed_forward.w2.weight": "layers.0.mlp.down_proj.weight",
    "layers.0.ffn_norm.weight": "layers.0.post_attention_layernorm.weight",
}


def _hf_name(part: str) -> str:
    return f"layers.0.{'self_attn' if part.endswith(('q_proj', 'k_proj', 'v_proj')) else 'mlp'}.{part}.weight"


class EagleHead(nn.Module):
    """fc over [embedding, feature] and one engine decoder Block (its input norm the identity)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        self.args = config.model_args()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        # EAGLE-3: the target's [low, mid, high] features -> one H-wide feature (format 2 heads only)
        self.fuse = nn.Linear(config.feature_width, config.hidden_size, bias=False) if config.feature_layers else None
        block = Block(self.args)
        block.attention_norm = nn.Identity()
        self.layers = nn.ModuleList([block])
        cos, sin = rope_tables(self.args, torch.device("cpu"))
        self.register_buffer("rope_cos", cos, persistent=False)  # [max_positions, D]
        self.register_buffer("rope_sin", sin, persistent=False)
        self.kv_cache: KVCache | None = None
        self._no_cache = _NoCache()

    def setup_cache(self, max_len: int) -> None:
        param = self.fc.weight
        a = self.args
        self.kv_cache = KVCache(a.n_kv_heads, max_len, a.head_dim, param.dtype, param.device)

    def fuse_true(self, features: torch.Tensor) -> torch.Tensor:
        """The target's true features -> the H-wide feature the head reads ([low, mid, high] fused for format 2)."""
        return self.fuse(features) if self.fuse is not None else features

    def feature_of(self, g: torch.Tensor) -> torch.Tensor:
        """What the head predicts of the target's final-norm feature: g itself."""
        return g

    def logits(self, g: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """Draft logits [.., V]: the target's LM head over g."""
        return g @ lm_head_weight.T

    def forward(
        self,
        features: torch.Tensor,  # [B, T, H] (or [B, T, (n + 1) * H] true multi-layer ones): f_i or the head's g_i
        embeds: torch.Tensor,  # [B, T, H]: embeddings of x_{i+1}
        start: int = 0,
        use_cache: bool = False,
        *,
        positions: torch.Tensor | None = None,  # [T]: RoPE positions (a draft tree's); default start..start+T-1
        mask: torch.Tensor | None = None,  # [T, start + T] bool: the slots each new position sees; default causal
    ) -> torch.Tensor:  # [B, T, H]: predicted f_{i+1}
        t = features.shape[1]
        block = self.layers[0]
        if use_cache:
            if self.kv_cache is None:
                raise EagleHeadError("call setup_cache() before drafting")
            block.attention.cache = self.kv_cache
        else:
            block.attention.cache, start = self._no_cache, 0
        if mask is None and t > 1:  # position start + i sees every cached position and the new ones up to itself
            mask = torch.ones(t, start + t, dtype=torch.bool, device=features.device).tril(diagonal=start)
        if self.fuse is not None and features.shape[-1] != self.config.hidden_size:
            features = self.fuse(features)  # true target features: [low, mid, high] -> H
        x = self.fc(torch.cat([embeds, features], dim=-1))
        if positions is None:
            cos, sin = self.rope_cos[start : start + t], self.rope_sin[start : start + t]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        return block(x, start, cos.to(x.dtype), sin.to(x.dtype), mask)

    # --- save / load ---------------------------------------------------------------------------------------

    def save(self, directory: Path, *, extra: dict | None = None) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        c = self.config
        hf_config = {
            "architectures": ["LlamaForCausalLM"],
            **llama_layer_keys(c),
            "ace_eagle": {**asdict(c), "format": c.format, **(extra or {})},
        }
        (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
        tensors = to_hf_tensors(self.state_dict())
        save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
        return directory

    @classmethod
    def load(cls, directory: Path, *, target_dir: Path | None = None, device: str | torch.device = "cpu"):
        """Load a head of any format (an Eagle3Head for format 3); with target_dir, refuse (EagleHeadError) a head
        trained for another target, or one from elsewhere whose shapes do not fit it."""
        config = read_head_config(directory, target_layers=_target_layers(target_dir))
        if target_dir is not None:
            check_target(config, target_dir)
        if config.eagle3:
            from speculation.engine.eagle3 import Eagle3Head

            return Eagle3Head.from_checkpoint(config, Path(directory)).to(device).eval()
        head = cls(config)
        try:
            head.load_state_dict(from_hf_tensors(load_file(str(Path(directory) / WEIGHTS_FILE))))
        except (RuntimeError, OSError, KeyError) as exc:
            raise EagleHeadError(f"cannot load the head's weights from {directory}: {exc}") from exc
        return head.to(device).eval()


def llama_layer_keys(c: EagleConfig) -> dict:
    """The head's decoder layer as a Llama config.json describes it (vLLM reads these keys for either format)."""
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def to_hf_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our fused layer tensors -> vLLM's EAGLE-1 names (q/k/v and gate/up split)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu", torch.float32).contiguous()
        if name in _FUSED:
            parts = _FUSED[name]
            sizes = _split_sizes(tensor, len(parts))
            for part, piece in zip(parts, tensor.split(sizes), strict=True):
                out[_hf_name(part)] = piece.contiguous()
        else:
            out[_RENAMED[name]] = tensor
    return out


def _split_sizes(tensor: torch.Tensor, n: int) -> list[int]:
    if n == 2:
        return [tensor.shape[0] // 2] * 2
    kv = (tensor.shape[0] - tensor.shape[1]) // 2  # wqkv: [H + 2 * kv_dim, H]
    return [tensor.shape[1], kv, kv]


def from_hf_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {ours: tensors[hf] for ours, hf in _RENAMED.items() if ours != "fuse.weight" or hf in tensors}
    for ours, parts in _FUSED.items():
        out[ours] = torch.cat([tensors[_hf_name(part)] for part in parts])
    return out


def make_head(config: EagleConfig) -> nn.Module:
    """A new head of the config's layout: an Eagle3Head (vLLM's EAGLE-3) or an EagleHead (formats 1 and 2)."""
    if config.eagle3:
        from speculation.engine.eagle3 import Eagle3Head

        return Eagle3Head(config)
    return EagleHead(config)


def read_head_config(directory: Path, *, target_layers: int | None = None) -> EagleConfig:
    """The head's config from its config.json: ACE's `ace_eagle` section, or an EAGLE-3 head's own keys (a head
    trained elsewhere; target_layers gives vLLM's default aux layers when it names none)."""
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EagleHeadError(f"{directory} is not an ACE EAGLE head directory (no readable config.json)") from exc
    meta = raw.get(ACE_SECTION) if isinstance(raw, dict) else None
    if not isinstance(meta, dict):
        if isinstance(raw, dict) and head_format(raw) == FORMAT_EAGLE3:
            return eagle3_config(raw, target_layers=target_layers, where=str(directory))
        raise EagleHeadError(f"{directory} is not an ACE EAGLE head directory (no ace_eagle) nor an EAGLE-3 head's")
    if meta.get("format") not in FORMATS:
        raise EagleHeadError(f"{directory}: head format {meta.get('format')} is not one of {FORMATS}")
    fields = EagleConfig.__dataclass_fields__
    config = {k: v for k, v in meta.items() if k in fields}
    config["feature_layers"] = tuple(int(i) for i in config.get("feature_layers") or ())
    return EagleConfig(**config)


def eagle3_config(raw: dict, *, target_layers: int | None = None, where: str = "the head") -> EagleConfig:
    """An EagleConfig for an EAGLE-3 head trained elsewhere (EAGLE authors' or speculators format); EagleHeadError
    naming what ACE's local path cannot run exactly."""
    problems = eagle3_problems(raw)
    if problems:
        raise EagleHeadError(f"{where}: an EAGLE-3 head with {'; '.join(problems)} does not run on ACE's engine")
    c = layer_config(raw)
    aux = aux_layer_ids(raw)
    if aux is None:
        if target_layers is None:
            raise EagleHeadError(f"{where} names no eagle_aux_hidden_state_layer_ids: give the target to read them")
        aux = default_aux_layer_ids(target_layers)
    try:
        heads = int(c["num_attention_heads"])
        return EagleConfig(
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(c.get("num_key_value_heads") or heads),
            vocab_size=int(c["vocab_size"]),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-5)),
            rope_theta=float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
            feature_layers=tuple(sorted({int(i) - 1 for i in aux})),
            eagle3=True,
            norm_before_residual=bool(c.get("norm_before_residual", False)),
            draft_vocab_size=int(c.get("draft_vocab_size") or 0),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise EagleHeadError(f"{where}: config.json lacks or mangles {exc}") from exc


def _target_layers(target_dir: Path | None) -> int | None:
    if target_dir is None:
        return None
    try:
        return int(json.loads((Path(target_dir) / CONFIG_FILE).read_text())["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_target(config: EagleConfig, target_dir: Path) -> None:
    """ACE's heads: the target's fingerprint must be the one the head was trained on. A head from elsewhere (no
    fingerprint): the target's hidden size, vocabulary and layer count must fit it."""
    if not config.target_fingerprint:
        _check_shapes(config, target_dir)
        return
    found = target_fingerprint(target_dir)
    if found != config.target_fingerprint:
        raise EagleHeadError(
            f"this EAGLE head was trained for target {config.target_name!r} (fingerprint "
            f"{config.target_fingerprint}), not for the target in {target_dir} (fingerprint {found}): "
            "train a head for this target"
        )


def _check_shapes(config: EagleConfig, target_dir: Path) -> None:
    try:
        target = json.loads((Path(target_dir) / CONFIG_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise EagleHeadError(f"cannot read the target's config.json in {target_dir}: {exc}") from exc
    problems = []
    if target.get("hidden_size") != config.hidden_size:
        problems.append(f"hidden size {config.hidden_size} (the target's: {target.get('hidden_size')})")
    if target.get("vocab_size") != config.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} (the target's: {target.get('vocab_size')})")
    layers = target.get("num_hidden_layers") or 0
    if any(i >= layers for i in config.feature_layers):
        problems.append(f"aux layers {[i + 1 for i in config.feature_layers]} (the target has {layers} layers)")
    if problems:
        raise EagleHeadError(f"this EAGLE head does not fit the target in {target_dir}: {'; '.join(problems)}")


def param_count(head: EagleHead) -> int:
    return sum(p.numel() for p in head.parameters())


def init_weights(head: EagleHead, generator: torch.Generator, std: float = 0.02) -> None:
    """Seeded initialisation (normal(0, std), norms at 1); fc starts as [0, I] so the first g is close to f."""
    if head.config.eagle3:
        head.init_weights(generator, std)
        return
    h = head.config.hidden_size
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
        head.fc.weight[:, h:] += torch.eye(h)
        if head.fuse is not None:
            head.fuse.weight[:, -h:] += torch.eye(h)  # starts as the final-norm feature: the EAGLE-1 start
        block = head.layers[0]
        block.attention.wo.weight.mul_(1 / math.sqrt(2))
        block.feed_forward.w2.weight.mul_(1 / math.sqrt(2))


# --- drafting --------------------------------------------------------------------------------------------------


class EagleDrafter:
    """The head's drafting state for one sequence, fed with the target's true features as they arrive.

    Position i of the head holds the pair (f_i, x_{i+1}). `observe` queues true pairs; `draft` feeds them
    (one batched call), then runs K - 1 more single steps on its own predicted features. Speculative cache
    entries past the true length are simply overwritten by the next `draft` (the cache is indexed by
    position, so rolling back is moving `true_length`).
    """

    def __init__(self, head: EagleHead, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, max_len: int):
        self.head = head
        self.embed_weight = embed_weight  # [V, H], the target's
        self.lm_head_weight = lm_head_weight  # [V, H], the target's
        head.setup_cache(max_len)
        self.max_len = max_len
        self.true_length = 0  # cache positions holding true (target) pairs
        self._features: list[torch.Tensor] = []
        self._tokens: list[torch.Tensor] = []

    def reset(self) -> None:
        self.true_length = 0
        self._features.clear()
        self._tokens.clear()

    @property
    def has_new(self) -> bool:
        """Whether true pairs are queued (drafting starts from the newest one)."""
        return bool(self._tokens)

    @property
    def observed_length(self) -> int:
        """Positions whose true pair is in the cache or queued."""
        return self.true_length + sum(t.numel() for t in self._tokens)

    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Queue true pairs (f_i, x_{i+1}) for the next positions: features [n, H], next_tokens [n]."""
        if features.shape[0] != next_tokens.numel():
            raise EagleHeadError(f"{features.shape[0]} features but {next_tokens.numel()} next tokens")
        if features.shape[0]:
            self._features.append(features)
            self._tokens.append(next_tokens.reshape(-1))

    @torch.no_grad()
    def draft(self, k: int, choose) -> tuple[torch.Tensor, torch.Tensor]:
        """K draft tokens [K] and their logits [K, V]; `choose(logits [V]) -> token []` picks each one."""
        if not self._tokens:
            raise EagleHeadError("the head has no new target feature to draft from")
        if self.observed_length + k - 1 > self.max_len:
            raise EagleHeadError(f"drafting past the head's cache of {self.max_len} positions")
        g = self.feed_true()  # [1, 1, H]
        drafted, all_logits = [], []
        for step in range(k):
            logits = self.logits(g[0, 0])  # [V]
            token = choose(logits)
            drafted.append(token)
            all_logits.append(logits)
            if step + 1 < k:
                embed = F.embedding(token.view(1, 1), self.embed_weight)
                g = self.head(g, embed, self.true_length + step, use_cache=True)
        return torch.stack(drafted), torch.stack(all_logits)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        """The head's draft logits [.., V] for its features g [.., H]."""
        return self.head.logits(g, self.lm_head_weight)

    @torch.no_grad()
    def feed_true(self) -> torch.Tensor:
        """Feed the queued true pairs (one batched call); the head's predicted feature after them [1, 1, H]."""
        if not self._tokens:
            raise EagleHeadError("the head has no new target feature to draft from")
        features = torch.cat(self._features)[None]  # [1, n, H]
        tokens = torch.cat(self._tokens)  # [n]
        self._features.clear()
        self._tokens.clear()
        start = self.true_length
        g = self.head(features, F.embedding(tokens, self.embed_weight)[None], start, use_cache=True)
        self.true_length = start + tokens.numel()
        return g[:, -1:]  # [1, 1, H]


@torch.no_grad()
def chain_logits_along(
    head: EagleHead,
    target_model: Transformer,
    sequence: list[int],
    hidden: Tensor,
    *,
    prompt_len: int,
    depth: int,
):
    """For each output position i (a step starting after prompt + output[:i]): the logits [d, V] of the head's
    chain of d = min(depth, outputs left) drafts, each drafted after the sequence's own tokens (the chain a step
    would draft where its earlier drafts passed: what a sampled chain's probability of passing is judged on).
    hidden: the target's features of ``sequence`` (as the replay hands them to the proposer). A generator: one
    chain at a time, K head steps each (n K in all, no target pass)."""
    drafter = EagleDrafter(head, target_model.tok_embeddings.weight, target_model.output.weight, target_model.max_len)
    device = target_model.output.weight.device
    ids = torch.tensor(sequence, device=device)
    observed = 0  # true pairs (f_t, x_{t+1}) queued or fed: t < observed
    for i in range(len(sequence) - prompt_len):
        committed = prompt_len + i
        if committed - 1 > observed:  # pairs up to the one ending at the last committed token
            drafter.observe(hidden[observed : committed - 1], ids[observed + 1 : committed])
            observed = committed - 1
        d = min(depth, len(sequence) - committed)
        if not drafter.has_new:  # a one-token prompt: no true pair yet, the step drafts nothing (as prod's)
            yield torch.empty(0, target_model.vocab_size, device=device)
        else:
            forced = iter(ids[committed : committed + d])
            yield drafter.draft(d, lambda _logits, it=forced: next(it))[1]
        drafter.observe(hidden[observed : observed + 1], ids[observed + 1 : observed + 2])  # the next true pair
        observed += 1


def chain_pass_probabilities(
    head: EagleHead,
    target_model: Transformer,
    sequence: list[int],
    hidden: Tensor,
    *,
    prompt_len: int,
    depth: int,
    p: Tensor,
    params: SamplingParams,
) -> list[list[float]]:
    """Per output position i, the probability that the j-th draft of the head's sampled chain starting there passed
    given the sampled tokens: min(1, q(o) / p(o)) (acceptance.pass_given_tokens), q the chain of
    ``chain_logits_along``; p [n, V] the target's processed distribution at the output positions (on the CPU)."""
    from speculation.engine.acceptance import pass_given_tokens

    chains = []
    logits_along = chain_logits_along(head, target_model, sequence, hidden, prompt_len=prompt_len, depth=depth)
    for i, logits in enumerate(logits_along):
        q = probs_from_logits(logits.float().cpu(), params)  # [d, V]
        tokens = torch.tensor(sequence[prompt_len + i : prompt_len + i + q.shape[0]], dtype=torch.long)
        chains.append(pass_given_tokens(p[i : i + tokens.numel()], q, tokens)[0].tolist())
    return chains


def greedy_choice(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


# --- the proposer ----------------------------------------------------------------------------------------------


class EagleProposer:
    """Drafts with an EAGLE head from the target's features; plugs into the engine's decode loop unchanged.

    The loop keeps the target one token behind the committed sequence, so after a verification the target's
    features for the last committed token and the accepted drafts (hidden[: num_accepted + 1]) are true
    features; they pair with the committed tokens that follow them. The prompt's features come from the
    prefill when the loop passes them through `observe_target` before the first proposal; otherwise the
    proposer recomputes them once (one extra target pass over the prompt, same KV values rewritten).
    """

    wants_hidden = True

    def __init__(
        self, head: EagleHead, target_model: Transformer, *, max_len: int | None = None, tree: TreeShape | None = None
    ):
        config = head.config
        if getattr(target_model, "implementation", "native") != "native":
            raise EagleHeadError(
                "EAGLE heads read the features of ACE's own model layer; this target runs through transformers "
                "(implementation generic)"
            )
        if config.vocab_size != target_model.vocab_size:
            raise VocabMismatchError(
                f"the head's vocabulary ({config.vocab_size}) differs from the target's ({target_model.vocab_size})"
            )
        if config.hidden_size != target_model.args.dim:
            raise EagleHeadError(
                f"the head reads features of size {config.hidden_size}; the target's are {target_model.args.dim}"
            )
        if any(not 0 <= i < target_model.args.n_layers for i in config.feature_layers):
            raise EagleHeadError(
                f"the head reads target layers {config.feature_layers}; the target has {target_model.args.n_layers}"
            )
        # the target features the loop hands over: the final-norm feature, or [low, mid, high] (EAGLE-3)
        self.wants_hidden = config.feature_layers or True
        self.head = head.eval()
        self.target_model = target_model
        self.device = target_model.output.weight.device
        self.drafter = EagleDrafter(
            head, target_model.tok_embeddings.weight, target_model.output.weight, max_len or target_model.max_len
        )
        self._pending: list[Tensor] = []  # true features whose next token is (or will be) committed
        self.tree = tree  # None: draft a chain; else an EAGLE-2 draft tree of this shape (engine/tree.py)

    @classmethod
    def from_dir(
        cls, head_dir: Path, target_model: Transformer, *, target_dir: Path, tree: TreeShape | None = None
    ) -> EagleProposer:
        """Load a saved head for this target; EagleHeadError when it was trained for another one."""
        head = EagleHead.load(head_dir, target_dir=target_dir, device=target_model.output.weight.device)
        return cls(head.to(target_model.output.weight.dtype), target_model, tree=tree)

    def begin(self, prompt_ids: list[int]) -> None:
        self.drafter.reset()
        self._pending.clear()

    def observe_target(self, hidden: Tensor, num_accepted: int) -> None:
        self._pending.append(hidden[: num_accepted + 1])

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        pass  # the drafter drops its speculative entries itself at the next proposal

    @torch.inference_mode()
    def propose(
        self,
        committed: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator | None,
        *,
        tree: TreeShape | None = None,
    ) -> Proposal:
        """tree: this step's shape (the lookahead's choice among the policy tree's family); None: self.tree."""
        if not self._pending and self.drafter.observed_length == 0 and len(committed) > 1:
            prompt = torch.tensor(committed[:-1], device=self.device)
            self._pending.append(self.target_model(prompt, 0, return_hidden=self.wants_hidden).hidden)
        if self._pending:
            features = torch.cat(self._pending)  # [n, H]
            self._pending.clear()
            start = self.drafter.observed_length
            next_tokens = committed[start + 1 : start + 1 + features.shape[0]]
            if len(next_tokens) != features.shape[0]:
                raise EagleHeadError("target features and committed tokens are out of step")
            self.drafter.observe(features, torch.tensor(next_tokens, device=self.device))
        k = min(k, self.drafter.max_len - self.drafter.observed_length)
        if k <= 0 or self.drafter.observed_length < len(committed) - 1 or not self.drafter.has_new:
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=self.device), q=None)
        if (tree or self.tree) is not None:
            return self._propose_tree(committed, k, tree or self.tree)
        if params.greedy:
            tokens, _ = self.drafter.draft(k, greedy_choice)
            return Proposal(tokens=tokens, q=None)
        qs: list[Tensor] = []

        def choose(logits: Tensor) -> Tensor:
            q = probs_from_logits(logits, params)
            qs.append(q)
            return sample(q, generator)

        tokens, _ = self.drafter.draft(k, choose)
        return Proposal(tokens=tokens, q=torch.stack(qs))

    def _propose_tree(self, committed: list[int], k: int, shape: TreeShape) -> Proposal:
        """A tree of at most k levels that fits the head's cache and the target's (root + nodes after it).

        The same tree serves greedy and sampled requests: its candidates are the head's top-k, a deterministic
        choice, which tree verification needs (engine/tree.py).
        """
        head_room = (self.drafter.max_len - self.drafter.observed_length) // shape.top_k + 1
        depth = min(shape.depth, k, head_room)
        nodes = min(shape.nodes, self.target_model.max_len - len(committed))
        if depth < 1 or nodes < 1:
            return Proposal(tokens=torch.empty(0, dtype=torch.long, device=self.device), q=None)
        tree = expand_eagle_tree(self.drafter, replace(shape, depth=depth, nodes=nodes))
        return Proposal(tokens=tree.tokens, q=None, tree=tree)
