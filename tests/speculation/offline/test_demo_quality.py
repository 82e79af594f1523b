"""The demo pair behaves like a real one: its target's greedy answers to
Spec-Bench prompts are mostly not loops, and each of its two drafts wins on its own kind of text (held-out real
text, teacher forced).

The targets of demo-v3 to demo-v5 loop on most prompts (docs/BENCHMARKS.md): the looping test skips there. The
drafts' test runs on every version with two drafts: demo-v3 (the main draft on code and comments,
``draft-prose`` on English) and demo-v6 on (the main draft on English, ``draft-code`` on code).
The models are deterministic once built, so the thresholds are not statistical; they leave room for a rebuild
on another CPU (weights are deterministic on one machine only) to differ by an output or two.
"""

from __future__ import annotations

import json

import pytest

from speculation.bench.engine import is_looping
from speculation.offline.eagle.prompts import spec_bench_path

LOOP_TOKENS = 64
# the benchmark's aim is a looping share < 0.2 over its 14 quick outputs; here 13 prompts (one per category):
# at most 3 may loop (0.23), one more than the aim allows, for a rebuild on another CPU
MAX_LOOPING = 3
MAX_GARBLED = 0.01  # share of decoded characters that are U+FFFD (a broken UTF-8 byte run) or control codes
LOOPING_TARGETS = ("demo-v3", "demo-v4", "demo-v5")  # measured to loop on most prompts (docs/BENCHMARKS.md)
SPECIALISTS = {"draft-code": "code", "draft-prose": "english"}  # a second draft's own kind of text
TEXT_WINDOWS = 64  # windows of 128 tokens: 8192 positions per kind (16 windows, as build_info has, moved the code
# figure by 0.01, more than one build's prose draft led the main draft by there)
HELD_OUT_BYTES = 400_000  # the build's held-out budget (Recipe.held_out_bytes)


@pytest.fixture(scope="module")
def engine_models(demo_pair):
    import torch
    from tokenizers import Tokenizer

    from speculation.engine import LocalTarget, load_causal_lm

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine stalls torch's thread barrier
    try:
        tokenizer = Tokenizer.from_file(str(demo_pair.target_dir / "tokenizer.json"))
        target = LocalTarget(load_causal_lm(demo_pair.target_dir, max_len=512))
        drafts = {label: load_causal_lm(path, max_len=512) for label, path in demo_pair.drafts.items()}
        yield tokenizer, target, drafts
    finally:
        torch.set_num_threads(threads)


def _first_question_per_category() -> list[str]:
    first: dict[str, str] = {}
    for line in spec_bench_path().read_text().splitlines():
        row = json.loads(line)
        first.setdefault(row["category"], row["turns"][0])
    return [first[category] for category in sorted(first)]


def test_the_targets_greedy_answers_to_spec_bench_prompts_are_mostly_not_loops(demo_pair, engine_models):
    from speculation.engine import GenerationConfig, generate

    if demo_pair.root.name in LOOPING_TARGETS:
        pytest.skip(f"{demo_pair.root.name}'s target is known to loop (docs/BENCHMARKS.md)")
    tokenizer, target, _ = engine_models
    eos = tokenizer.token_to_id("</s>")
    config = GenerationConfig(max_new_tokens=LOOP_TOKENS, stop_token_ids=(eos,))
    outputs = [
        generate(target, None, tokenizer.encode(q).ids[:256], config).tokens for q in _first_question_per_category()
    ]
    assert len(outputs) == 13
    assert sum(len(tokens) for tokens in outputs) > 13 * LOOP_TOKENS // 2  # answers, not an early end of text
    looping = [tokenizer.decode(tokens) for tokens in outputs if is_looping(tokens)]
    assert len(looping) <= MAX_LOOPING, looping
    # not loops, and not noise either: a target pushed too hard against repetition answers in stray bytes
    text = "".join(tokenizer.decode(tokens) for tokens in outputs)
    garbled = sum(ch == "\ufffd" or (ord(ch) < 32 and ch not in "\n\t") for ch in text)
    assert garbled <= MAX_GARBLED * len(text), text[:400]


def _teacher_forced_alpha(demo_pair, held_ids, seed: int) -> dict[str, float]:
    """Each draft's greedy acceptance on ``TEXT_WINDOWS`` seeded windows of held-out real text (teacher forced)."""
    import torch
    from transformers import LlamaForCausalLM

    from speculation.offline.demo.train import greedy_agreement

    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, held_ids.numel() - 129, (TEXT_WINDOWS,), generator=generator).tolist()
    windows = torch.stack([held_ids[s : s + 128] for s in starts])
    target = LlamaForCausalLM.from_pretrained(demo_pair.target_dir).eval()
    return {
        label: greedy_agreement(LlamaForCausalLM.from_pretrained(path).eval(), target, windows, start=1)
        for label, path in demo_pair.drafts.items()
    }


def test_each_draft_wins_on_its_own_kind_of_text(demo_pair):
    """On held-out real text of each kind (English paragraphs each after BOS, as requests arrive; stdlib code
    neither draft trained on), teacher forced, each draft agrees with the target more often on its own kind.

    Not asserted: speculation on Spec-Bench's English requests. demo-v3's target answers them with comment loops
    (``#  If the`` repeated) that any draft follows, so both drafts accept about 5.5 of 6 there and the order is
    noise: 5.85 vs 5.56 for the prose draft on one build, 5.41 vs 5.69 on another CPU's build of the same seeded
    recipe, and 5.31-5.69 across prose-draft variants on that build. Nor speculation on held-out code files: the
    code draft leads there on demo-v3 (5.05 vs 4.47) but not on demo-v9 (2.12 vs 2.19; docs/BENCHMARKS.md)."""
    from tokenizers import Tokenizer

    from speculation.offline.demo.build import _encode, _paragraph_ids
    from speculation.offline.demo.corpus import stdlib_corpus

    if len(demo_pair.extra_drafts) != 1:
        pytest.skip(f"{demo_pair.root.name} has {len(demo_pair.drafts)} drafts, not two")
    (second,) = demo_pair.extra_drafts
    corpus = stdlib_corpus()
    tokenizer = Tokenizer.from_file(str(demo_pair.target_dir / "tokenizer.json"))
    english = corpus.english_text(HELD_OUT_BYTES, held_out=True)
    held = {
        "english": _paragraph_ids(tokenizer, english),
        "code": _encode(tokenizer, corpus.held_out_text(HELD_OUT_BYTES)),
    }
    alpha = {kind: _teacher_forced_alpha(demo_pair, ids, seed=7) for kind, ids in held.items()}
    own, other = SPECIALISTS[second], next(kind for kind in held if kind != SPECIALISTS[second])
    assert alpha[own][second] > alpha[own]["draft"], alpha
    assert alpha[other]["draft"] > alpha[other][second], alpha
