"""ACE's speculative decoding engine: pure PyTorch + stdlib + safetensors (no Django, Celery or settings).

Entry points:
- ``load_causal_lm(dir)`` -> ``Transformer`` (an HF checkpoint of Llama, Mistral, Qwen 2/3, Gemma 2/3 or Phi-3,
  ``engine/families.py``; its KV cache a row of the batch engine's, ``engine/batch_model.py``), or
  ``GenericCausalLM`` for another dense decoder-only model transformers implements (``engine/generic.py``;
  ``implementation`` says which);
  ``Transformer.forward(tokens, start, return_hidden=False)`` -> logits [T, V] (+ hidden [T, D]).
- targets: ``LocalTarget(model)``; proposers: ``DraftModelProposer(model, target_vocab_size=...)``,
  ``NgramProposer()``, ``SuffixProposer(SuffixIndex())`` (suffix decoding over earlier responses),
  ``HybridProposer(lookup, draft_proposer, model_k=...)`` (a lookup first, the draft where it finds little; protocols
  ``Target`` / ``Proposer``; ``Proposer.observe_target`` for EAGLE heads);
  ``EagleProposer(head, target_model, tree=TreeShape(...))`` drafts EAGLE-2 trees (``engine/tree.py``).
- ``generate(target, proposer, prompt_ids, GenerationConfig(...), on_tokens=None)`` -> ``GenerationResult``: the
  batch engine's step (``BatchDecoder``, ``engine/batch.py``) run for one request;
  ``generate_plain(target, prompt_ids, config)`` for baselines.
- shadow replay, through the same loop on a ``ReplayTarget`` (a known output): ``replay_proposer(proposer, ...)``,
  ``replay_greedy`` (a draft's teacher-forced predictions), ``draft_greedy_predictions``,
  ``expected_acceptance``; ``expected_hybrid`` (a hybrid or draft on a sampled request: expected counts).

Names are exported lazily (PEP 562), so importing a torch-free submodule such as
``speculation.engine.projection`` (the web process does) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BatchDecoder": "batch",
    "SlotUpdate": "batch",
    "GenerationConfig": "request",
    "GenerationResult": "request",
    "generate": "decode",
    "generate_plain": "decode",
    "step_lookahead": "request",
    "ContextLengthError": "errors",
    "EmptyPromptError": "errors",
    "LookaheadError": "errors",
    "ModelFormatError": "errors",
    "SamplingParamError": "errors",
    "SpecDecodeError": "errors",
    "VocabMismatchError": "errors",
    "load_causal_lm": "loader",
    "DEFAULT_K": "lookahead",
    "K_MAX": "lookahead",
    "K_MIN": "lookahead",
    "DynamicLookahead": "lookahead",
    "LoadAwareLookahead": "lookahead",
    "Lookahead": "lookahead",
    "StepReport": "lookahead",
    "TreeLookahead": "lookahead",
    "expected_tokens": "lookahead",
    "ModelArgs": "model",
    "Transformer": "model",
    "init_weights": "model",
    "DraftModelProposer": "proposers",
    "HYBRID_LOOKUP_K": "proposers",
    "HYBRID_MIN_LOOKUP": "proposers",
    "HybridProposer": "proposers",
    "LookupProposer": "proposers",
    "NgramProposer": "proposers",
    "SuffixIndex": "suffix",
    "SuffixProposer": "suffix",
    "Proposal": "proposers",
    "Proposer": "proposers",
    "KnownDrafts": "replay",
    "ReplayTarget": "replay",
    "draft_greedy_predictions": "replay",
    "expected_acceptance": "replay",
    "expected_hybrid": "replay",
    "replay_greedy": "replay",
    "replay_proposer": "replay",
    "replay_proposals": "replay",
    "teacher_forced": "replay",
    "SamplingParams": "sampling",
    "probs_from_logits": "sampling",
    "SpecStats": "stats",
    "LocalTarget": "target",
    "Target": "target",
    "TargetOutput": "target",
    "DraftTree": "tree",
    "TreeShape": "tree",
    "verify_greedy": "verify",
    "verify_sampled": "verify",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'speculation.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"speculation.engine.{module}"), name)
    globals()[name] = value
    return value
