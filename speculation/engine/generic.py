"""Dense decoder-only models that ACE's own layer does not describe (engine/families.py) but transformers implements
(GPT-NeoX / Pythia, OPT, GPT-2, Falcon, StableLM, OLMo, ...): transformers' own model behind the interface the
decode loop, LocalTarget and DraftModelProposer use (``forward(tokens, start)``, ``max_len``, ``vocab_size``,
``output``).

Exact, since it is the reference implementation, and slower than the native layer: its DynamicCache grows by
concatenation, and a rejection cuts it back with ``crop`` to the accepted length. Batch one only (the batch loop
runs the native layer's blocks over its own cache), no draft trees and no EAGLE features: those need the native
layer, and a request for them is refused, naming the model type.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor, nn

from speculation.engine.batch_model import ForwardOutput, HiddenRequest
from speculation.engine.errors import ModelFormatError

logger = logging.getLogger(__name__)


class GenericCausalLM(nn.Module):
    """transformers' causal LM with one DynamicCache; ``forward(tokens, start)`` first cuts the cache to ``start``."""

    implementation = "generic"

    def __init__(self, hf: nn.Module, *, max_positions: int):
        super().__init__()
        from transformers import DynamicCache

        self.hf = hf
        self.model_type = str(hf.config.model_type)
        self.max_positions = max_positions
        self.max_len = max_positions
        self._new_cache = DynamicCache
        self.cache = DynamicCache()

    @property
    def output(self) -> nn.Module:
        """The LM head (its weight's device is the model's)."""
        return self.hf.get_output_embeddings()

    @property
    def vocab_size(self) -> int:
        return int(self.output.weight.shape[0])

    def setup_cache(self, max_len: int | None = None) -> None:
        """The longest context served (the cache itself grows as it is used)."""
        self.max_len = min(max_len or self.max_positions, self.max_positions)
        self.cache = self._new_cache()

    def forward(
        self,
        tokens: Tensor,
        start: int,
        return_hidden: HiddenRequest = False,
        *,
        positions: Tensor | None = None,
        mask: Tensor | None = None,
    ) -> ForwardOutput:
        """tokens [T] at positions start..start+T-1 -> logits [T, V] float32; cached positions past start are
        dropped first (a rejection's cut), start 0 begins a new cache."""
        if return_hidden or positions is not None or mask is not None:
            raise ModelFormatError(
                f"model_type {self.model_type!r} runs through transformers (generic): EAGLE features and draft trees "
                "need a family ACE runs natively"
            )
        t = tokens.shape[-1]
        if start + t > self.max_len:
            raise ValueError(f"positions {start}..{start + t - 1} exceed the KV cache of {self.max_len}")
        cached = self.cache.get_seq_length()
        if start == 0:
            self.cache = self._new_cache()
        elif start < cached:
            self.cache.crop(start - cached)  # a negative count: drop that many positions from the end
        elif start > cached:
            raise ValueError(f"position {start} does not follow the {cached} cached positions")
        out = self.hf(input_ids=tokens.view(1, t), cache=self.cache, use_cache=True)
        return ForwardOutput(logits=out.logits[0].float(), hidden=None)

    def param_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def load_generic(
    directory: Path, config: dict, *, device: torch.device, dtype: torch.dtype, max_len: int | None
) -> GenericCausalLM:
    """transformers' model of a checkpoint (a model type it implements as a causal LM), checked to keep a KV cache
    that can be cut back; ModelFormatError naming what stands in the way."""
    import transformers
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelFormatError(f"model_type {model_type!r} is not a causal LM transformers implements")
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelFormatError(f"{directory}: transformers cannot load it: {str(exc)[:300]}") from exc
    positions = getattr(hf.config, "max_position_embeddings", None)
    if not positions:
        raise ModelFormatError(f"config.json: model_type {model_type!r} gives no max_position_embeddings")
    hf = hf.to(device).eval().requires_grad_(False)
    model = GenericCausalLM(hf, max_positions=int(positions))
    model.setup_cache(max_len)
    # the cache must be transformers' DynamicCache of plain KV layers, and the first token must not see the second
    with torch.inference_mode():
        try:
            two = hf(input_ids=torch.tensor([[0, 1]], device=device)).logits[0, 0].float()
            out = hf(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), cache=DynamicCache(), use_cache=True)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ModelFormatError(f"model_type {model_type!r}: a forward with a KV cache fails: {exc}") from exc
    one = out.logits[0, 0].float()
    if (two - one).abs().max() > 1e-2 * one.abs().max() + 1e-3:  # half-precision noise is far below this
        raise ModelFormatError(f"model_type {model_type!r} is not a causal decoder (a token attends to later ones)")
    cache = getattr(out, "cache", None)
    if not isinstance(cache, DynamicCache) or not all(type(layer) is DynamicLayer for layer in cache.layers):
        raise ModelFormatError(
            f"model_type {model_type!r} keeps a state that cannot be cut back after a rejection (not a plain KV cache)"
        )
    logger.info("%s: model_type %r runs through transformers (generic: exact, slower)", directory, model_type)
    return model
