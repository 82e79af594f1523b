"""ACE's speculative decoding engine: pure PyTorch + stdlib + safetensors (no Django, Celery or settings).

Entry points:
- ``load_causal_lm(dir)`` -> ``Transformer`` (Llama-format HF checkpoint, static KV cache);
  ``Transformer.forward(tokens, start, return_hidden=False)`` -> logits [T, V] (+ hidden [T, D]).
- targets: ``LocalTarget(model)``; proposers: ``DraftModelProposer(model, target_vocab_size=...)``,
  ``NgramProposer()`` (protocols ``Target`` / ``Proposer``; ``Proposer.observe_target`` for EAGLE heads).
- ``generate(target, proposer, prompt_ids, GenerationConfig(...), on_tokens=None)`` -> ``GenerationResult``;
  ``generate_plain(target, prompt_ids, config)`` for baselines.
- shadow replay: ``replay_greedy``, ``draft_greedy_predictions``, ``expected_acceptance``.
"""

from speculation.engine.decode import GenerationConfig, GenerationResult, generate, generate_plain, step_lookahead
from speculation.engine.errors import (
    ContextLengthError,
    EmptyPromptError,
    LookaheadError,
    ModelFormatError,
    SamplingParamError,
    SpecDecodeError,
    VocabMismatchError,
)
from speculation.engine.loader import load_causal_lm
from speculation.engine.lookahead import DEFAULT_K, K_MAX, K_MIN, DynamicLookahead, expected_tokens
from speculation.engine.model import ModelArgs, Transformer, init_weights
from speculation.engine.proposers import DraftModelProposer, NgramProposer, Proposal, Proposer
from speculation.engine.replay import draft_greedy_predictions, expected_acceptance, replay_greedy
from speculation.engine.sampling import SamplingParams, probs_from_logits
from speculation.engine.stats import SpecStats
from speculation.engine.target import LocalTarget, Target, TargetOutput
from speculation.engine.verify import verify_greedy, verify_sampled

__all__ = [
    "DEFAULT_K",
    "K_MAX",
    "K_MIN",
    "ContextLengthError",
    "DraftModelProposer",
    "DynamicLookahead",
    "EmptyPromptError",
    "GenerationConfig",
    "GenerationResult",
    "LocalTarget",
    "LookaheadError",
    "ModelArgs",
    "ModelFormatError",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "SamplingParamError",
    "SamplingParams",
    "SpecDecodeError",
    "SpecStats",
    "Target",
    "TargetOutput",
    "Transformer",
    "VocabMismatchError",
    "draft_greedy_predictions",
    "expected_acceptance",
    "expected_tokens",
    "generate",
    "generate_plain",
    "init_weights",
    "load_causal_lm",
    "probs_from_logits",
    "replay_greedy",
    "step_lookahead",
    "verify_greedy",
    "verify_sampled",
]
