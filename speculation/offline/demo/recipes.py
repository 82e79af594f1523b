"""The demo versions' recipes (``RECIPES``: what each is trained on and how long) and their drafts' labels."""

from __future__ import annotations

from dataclasses import dataclass, replace

from speculation.offline.demo.train import DRAFT_SHAPE, TARGET_SHAPE, ModelShape, TrainPlan


@dataclass(frozen=True)
class Recipe:
    """What one demo version is trained on and how long; ``english``: prose mixed into tokenizer, target and
    distillation (``Corpus.english_text``) instead of the code's comment lines only."""

    plan: TrainPlan
    target_shape: ModelShape = TARGET_SHAPE
    draft_shape: ModelShape = DRAFT_SHAPE
    tokenizer_bytes: int = 1_500_000
    train_bytes: int = 3_000_000
    held_out_bytes: int = 400_000
    prose_bytes: int = 600_000
    english: bool = False
    english_sources: tuple[str, ...] = ()  # Corpus.english_text's sources (all when empty)
    paragraphs: bool = False  # English as unwrapped paragraphs, each after BOS (as prompts arrive) (v5 on)
    code_draft: bool = False  # a second draft, "draft-code", distilled on code only; "draft" then on prose only
    # a further draft, "draft-prose", distilled with this plan on English only: paragraphs after BOS, the target
    # continuing each from its start (``distill_draft(paragraph_prompts=True)``); None: no such draft
    prose_draft: TrainPlan | None = None
    # the drafts' code and prose budgets when wider than the target's (0: the target's text): the drafts then learn
    # the target's logits and continuations on text it never trained on too (a memorising target, v9)
    draft_train_bytes: int = 0
    draft_prose_bytes: int = 0
    draft_english_sources: tuple[str, ...] = ()  # the drafts' English sources when not the target's (v10)
    # where foreign prefixes (``TrainPlan.foreign_share``) come from: English paragraphs of these sources, and the
    # code past the target's own ``train_bytes`` up to this budget
    foreign_sources: tuple[str, ...] = ("docstrings",)
    foreign_prose_bytes: int = 0
    foreign_code_bytes: int = 0


_V4 = Recipe(
    plan=TrainPlan(
        seq_len=256,
        target_batch=4,
        target_steps=140,
        target_lr=2e-3,
        draft_batch=8,
        draft_steps=150,
        teacher_real=12,
        gen_prompts=24,
        gen_prompt_len=32,
        gen_new_tokens=96,
        prose_share=0.5,
        unlikelihood=0.5,
    ),
    target_shape=ModelShape(hidden_size=256, num_layers=8, num_heads=4, intermediate_size=704),
    draft_shape=ModelShape(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=352),
    prose_bytes=1_200_000,
    english=True,
)
# v5: as v4, but the English comes as unwrapped paragraphs each starting with BOS (v4's greedy output fell into
# newline loops: hard-wrapped docstrings taught it that a line ends after a few words), more of it (70 %), more
# steps and the unlikelihood weight of the paper (1.0)
_V5 = replace(_V4, plan=replace(_V4.plan, target_steps=160, prose_share=0.7, unlikelihood=1.0), paragraphs=True)

_V6 = replace(
    _V5,
    plan=replace(_V5.plan, target_steps=240, seq_ul_every=2, seq_ul_from=80),
    english_sources=("docstrings", "pydoc topics"),
    code_draft=True,
)

_V7 = replace(_V6, plan=replace(_V6.plan, unseen_penalty=1.0))

# v9: the opposite of v4-v8's unlikelihood on an undertrained target: a target that has memorised a small clean
# corpus (the first 25 kB of the reference manual as paragraphs after BOS, 10 kB of code: 7.3k + 3.9k tokens,
# 44 / 35 epochs in 450 steps, final loss 0.09), no unlikelihood at all; greedy output stitches memorised passages,
# which do not loop. The drafts learn the target on 200 kB of code / 300 kB of the manual (text it never saw, where
# its output is least predictable) from a 768-row pool. Measured: 596 s wall / 595 s CPU; looping 0.0 of 42
# outputs at 32 and 128 tokens, no stray bytes, but the text fuses words where it jumps between passages;
# held-out alpha on the target's continuations 0.57 (draft, English), 0.66 (draft-code, code), teacher forced
# 0.40 / 0.48 (below test_demo_pair's floors), so it is not DEMO_VERSION
_V9 = replace(
    _V4,
    plan=replace(
        _V4.plan,
        target_steps=450,
        draft_steps=1000,
        teacher_real=256,
        gen_prompts=512,
        prose_share=0.7,
        unlikelihood=0.0,
    ),
    train_bytes=10_000,
    prose_bytes=25_000,
    english_sources=("pydoc topics",),
    paragraphs=True,
    code_draft=True,
    draft_train_bytes=200_000,
    draft_prose_bytes=300_000,
)

# v10: v9's memorising target, half of whose training rows start with a foreign prefix (a docstring paragraph or
# stdlib code it never learns, 8-63 tokens, left out of the loss) before its own text from a paragraph start: asked
# anything, it answers with a memorised passage and keeps to it, where v9 jumped between passages at almost every
# word. Its drafts distil its continuations of docstrings (the main draft) and of wider code (draft-code).
_V10 = replace(
    _V9,
    plan=replace(_V9.plan, foreign_share=0.5),
    foreign_prose_bytes=300_000,
    foreign_code_bytes=200_000,
    draft_english_sources=("docstrings",),
)

RECIPES = {
    # v3: 30k target tokens of code; greedy output on Spec-Bench prompts mostly loops. Its second draft:
    # distilled on English paragraphs only, the
    # target continuing 32-token paragraph starts, twice the main draft's steps and pool (150 steps on 48 rows lost
    # to the main draft on English too)
    "demo-v3": Recipe(
        plan=TrainPlan(), prose_draft=TrainPlan(draft_steps=300, gen_prompts=64, teacher_real=32, gen_prompt_len=32)
    ),
    # v4: half English, 256-token windows, 4x the target tokens of v3 on a narrower target (8 x 256: twice
    # the tokens per CPU second), unlikelihood against copying loops; the draft 2 x 128, distilled as before
    "demo-v4": _V4,
    "demo-v5": _V5,
    # v6: as v5 with 1.5x the steps, the English from docstrings and the reference manual only (v5's loops were
    # mostly licence and changelog phrases), sequence-level unlikelihood on the target's own greedy continuations
    # every 2nd step from step 80 (v5 still looped on 64 % of the quick outputs), and a second draft
    # ("draft-code", distilled on code only; "draft" on English only). Measured: its greedy output does not loop,
    # but it is stray bytes (the penalty at weight 1.0 on an undertrained target pushes the mass onto rare byte
    # tokens), so it is not DEMO_VERSION
    "demo-v6": _V6,
    # v7: as v6, and a penalty on the probability of the tokens the text never has (v6's stray bytes: they all
    # keep one tied bigram-initialised logit, which wins once the repetitions are pushed down). Measured: no stray
    # bytes, loops halved against v5 (0.26 of 42 outputs at 32 tokens, 0.38 at 128) but
    # above the aim (< 0.2) and the text is word salad, so it is not DEMO_VERSION either
    "demo-v7": _V7,
    # v8: as v7 without the token-level unlikelihood (at weight 1.0 it pushed down every token already in the
    # 256-token window, common words and subwords included, so v7 answered in rare word fragments: the word
    # salad), 300 target steps, the sequence-level unlikelihood from step 100 on 96-token continuations.
    # Measured: English-like text, no stray bytes, but it
    # loops more than v7 (0.48 of 42 outputs at 32 tokens, 0.40 at 128), so it is not DEMO_VERSION
    "demo-v8": replace(
        _V7, plan=replace(_V7.plan, target_steps=300, unlikelihood=0.0, seq_ul_from=100, seq_ul_new_tokens=96)
    ),
    "demo-v9": _V9,
    # v10 (DEMO_VERSION): v9 with foreign prefixes, so any prompt is answered with a memorised
    # passage followed faithfully (docs/BENCHMARKS.md, "Demo pair"): no loops, draft alpha 0.69
    "demo-v10": _V10,
}

MAIN_DRAFT = "draft"
CODE_DRAFT, PROSE_DRAFT = "draft-code", "draft-prose"
DRAFT_LABELS = (MAIN_DRAFT, CODE_DRAFT, PROSE_DRAFT)  # subdirectories of a version that hold drafts, main first


def recipe_drafts(recipe: Recipe) -> tuple[str, ...]:
    """The drafts a build of ``recipe`` makes, main first."""
    return (MAIN_DRAFT, *([CODE_DRAFT] if recipe.code_draft else []), *([PROSE_DRAFT] if recipe.prose_draft else []))
