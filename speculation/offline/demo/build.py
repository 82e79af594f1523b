"""Build (once) and locate the demo target/draft pair under ``$ACE_HOME/models/<version>``.

``DEMO_VERSION`` names the pair the product uses (``ACE_DEMO_VERSION`` in the environment overrides it, so a
new version can be tried without switching); every version's recipe stays in ``RECIPES`` (``recipes.py``) so a
fresh machine builds exactly what the name promises, and switching versions is that one line.

``ensure_demo_pair()`` returns a ``DemoPair``:
- ``root``: ``$ACE_HOME/models/<version>``; ``target_dir``; ``draft_dir``: the main draft (``root/draft``);
- ``drafts``: every draft of the version that is on disk, ``{label: directory}``, the main one first:
  ``{"draft": root/draft}``, and from demo-v6 on also ``"draft-code"``: a second draft of the same tokenizer
  distilled on code only (the main draft is distilled mostly on English), so each wins on its own workload;
  demo-v3 (a code target, its main draft distilled on code and comments) has ``"draft-prose"`` instead,
  distilled on English paragraphs only, as requests arrive;
- ``extra_drafts``: ``drafts`` without the main one (``{}`` for versions with one draft);
- ``build_info``: the build's figures (``build_info.json``).

The build writes into a temporary directory and renames it into place, so a crashed build is never used;
a lock file keeps two processes from building at the same time. A version built before its recipe had a draft
gets that draft on the next ``ensure_demo_pair()`` (``add_missing_drafts``: distilled from the saved target,
the target untouched), as a fresh build would make it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM

from speculation.offline.demo.corpus import stdlib_corpus, unwrap_paragraphs
from speculation.offline.demo.recipes import (
    CODE_DRAFT,
    DRAFT_LABELS,
    MAIN_DRAFT,
    PROSE_DRAFT,
    RECIPES,
    Recipe,
    recipe_drafts,
)
from speculation.offline.demo.shipped import HEAD_SUFFIX, ShippedModelError, install_shipped, shipped_dirs
from speculation.offline.demo.tokenizer import BOS, EOS, PAD, save_tokenizer, train_tokenizer
from speculation.offline.demo.train import (
    MAX_POSITIONS,
    TrainPlan,
    bigram_init,
    distill_draft,
    greedy_agreement,
    greedy_continuations,
    llama_config,
    train_target,
)

logger = logging.getLogger(__name__)

SEED = 20261129
VOCAB_SIZE = 2048
BUILD_INFO = "build_info.json"
BUILD_THREADS = 1


DEFAULT_DEMO_VERSION = "demo-v10"  # the pair the product, its tests and the run command use
DEMO_VERSION = os.environ.get("ACE_DEMO_VERSION") or DEFAULT_DEMO_VERSION
DEMO_NAME = DEMO_VERSION


@dataclass(frozen=True)
class DemoPair:
    root: Path
    target_dir: Path
    draft_dir: Path

    @property
    def build_info(self) -> dict:
        return json.loads((self.root / BUILD_INFO).read_text())

    @property
    def drafts(self) -> dict[str, Path]:
        """Every draft of this version on disk, ``{label: directory}``, the main draft (``draft_dir``) first."""
        found = {MAIN_DRAFT: self.draft_dir}
        found.update({label: self.root / label for label in DRAFT_LABELS[1:] if (self.root / label).is_dir()})
        return found

    @property
    def extra_drafts(self) -> dict[str, Path]:
        """The drafts besides the main one (e.g. ``{"draft-code": ...}``); empty for one-draft versions."""
        return {label: path for label, path in self.drafts.items() if label != MAIN_DRAFT}


def ace_home() -> Path:
    return Path(os.environ.get("ACE_HOME") or Path.home() / ".cache" / "ace")


def ensure_demo_pair(*, models_dir: Path | None = None, version: str | None = None) -> DemoPair:
    """Return the demo pair (``DEMO_VERSION`` unless ``version`` names another): installed from the repository's
    shipped models (``shipped.py``; with its EAGLE head) when they are there, else built first (about 12 minutes
    on 2 CPU cores) if it is not cached."""
    name = version or DEMO_VERSION
    if name not in RECIPES:
        raise ValueError(
            f"unknown demo pair version {name!r} (known: {', '.join(RECIPES)}; ACE_DEMO_VERSION picks one)"
        )
    models_dir = models_dir or ace_home() / "models"
    models_dir.mkdir(parents=True, exist_ok=True)
    final = models_dir / name
    pair = DemoPair(root=final, target_dir=final / "target", draft_dir=final / "draft")
    if shipped_dirs(name) and not (final.is_dir() and (models_dir / (name + HEAD_SUFFIX)).is_dir()):
        with _locked(models_dir / f"{name}.lock"):
            try:
                install_shipped(name, models_dir)
            except ShippedModelError as exc:  # built below instead, as on a clone without shipped models
                logger.warning("%s: building the demo pair instead", exc)
    if final.is_dir():
        if _missing_drafts(final, RECIPES[name]):  # built before its recipe had them
            with _locked(models_dir / f"{name}.lock"):
                if _missing_drafts(final, RECIPES[name]):
                    add_missing_drafts(final, name=name)
        return pair
    with _locked(models_dir / f"{name}.lock"):
        if final.is_dir():  # another process built it while we waited
            return pair
        for stale in models_dir.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = models_dir / f".{name}.tmp-{os.getpid()}"
        tmp.mkdir()
        try:
            build_demo_pair(tmp, name=name)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return pair


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_demo_pair(out: Path, name: str | None = None, recipe: Recipe | None = None) -> dict:
    """Train and save the pair into ``out``; one torch thread, so the weights do not depend on the core count
    (and a shared machine's other jobs do not stall the thread barrier)."""
    name = name or DEMO_VERSION
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        return _build(out, name, recipe or RECIPES[name])
    finally:
        torch.set_num_threads(threads)


def _encode(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False).ids)


def _build(out: Path, name: str, recipe: Recipe) -> dict:
    started, cpu_started = time.perf_counter(), time.process_time()
    torch.manual_seed(SEED)
    corpus = stdlib_corpus()
    tokenizer, texts = _tokenize(corpus, recipe)
    held_ids = _encode(tokenizer, corpus.held_out_text(recipe.held_out_bytes))
    logger.info(
        "tokenizer: %d tokens of training text, %d held out (%.0fs)",
        texts.ids.numel(),
        held_ids.numel(),
        time.perf_counter() - started,
    )
    special = _special_ids(tokenizer)
    draft_texts = _draft_texts(corpus, tokenizer, recipe, texts)
    foreign = _foreign_texts(corpus, tokenizer, recipe)
    models, losses = _train_models(recipe, tokenizer.get_vocab_size(), special, texts, draft_texts, foreign)
    target = models.pop("target")
    info = _draft_figures(target, models, corpus, tokenizer, recipe)
    info.update(
        name=name,
        seed=SEED,
        vocab_size=tokenizer.get_vocab_size(),
        **losses,
        target_params=sum(p.numel() for p in target.parameters()),
        draft_params=sum(p.numel() for p in models["draft"].parameters()),
        train_tokens=texts.ids.numel(),
        held_out_tokens=held_ids.numel(),
        build_seconds=round(time.perf_counter() - started, 1),
        build_cpu_seconds=round(time.process_time() - cpu_started, 1),  # wall time also counts others' jobs
        torch_threads=torch.get_num_threads(),
    )
    for label, model in models.items():
        _save_checkpoint(model, out / label, tokenizer, special)
    _save_checkpoint(target, out / "target", tokenizer, special)
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    logger.info("demo pair built in %.0fs: %s", info["build_seconds"], info)
    return info


def add_missing_drafts(root: Path, *, name: str) -> dict:
    """Distil the drafts the recipe of version ``name`` has and ``root`` (built before the recipe had them) lacks,
    from the saved target and tokenizer, exactly as ``_build`` does (same texts, seeds, one thread); each draft is
    written to a temporary directory renamed into place, and build_info.json gains their figures (and every
    draft's on code and prose) by an atomic replace. The caller holds the version's lock."""
    threads = torch.get_num_threads()
    torch.set_num_threads(BUILD_THREADS)
    try:
        return _add_drafts(root, RECIPES[name], _missing_drafts(root, RECIPES[name]))
    finally:
        torch.set_num_threads(threads)


def _add_drafts(root: Path, recipe: Recipe, labels: list[str]) -> dict:
    from tokenizers import Tokenizer

    started, cpu_started = time.perf_counter(), time.process_time()
    for stale in root.glob(".draft*.tmp-*"):  # a crashed add
        shutil.rmtree(stale, ignore_errors=True)
    tokenizer = Tokenizer.from_file(str(root / "target" / "tokenizer.json"))
    corpus = stdlib_corpus()
    texts = _texts(corpus, tokenizer, recipe, corpus.train_text(max(recipe.tokenizer_bytes, recipe.train_bytes)))
    target = LlamaForCausalLM.from_pretrained(root / "target").eval()
    special = _special_ids(tokenizer)
    texts = _draft_texts(corpus, tokenizer, recipe, texts)
    new, losses = _train_drafts(recipe, tokenizer.get_vocab_size(), special, texts, target, only=labels)
    drafts = {label: LlamaForCausalLM.from_pretrained(root / label).eval() for label in _on_disk(root, recipe)}
    figures = _draft_figures(target, {**drafts, **new}, corpus, tokenizer, recipe)
    for label, model in new.items():
        tmp = root / f".{label}.tmp-{os.getpid()}"
        _save_checkpoint(model, tmp, tokenizer, special)
        os.rename(tmp, root / label)
    added = {
        "seconds": round(time.perf_counter() - started, 1),
        "cpu_seconds": round(time.process_time() - cpu_started, 1),
    }
    info = json.loads((root / BUILD_INFO).read_text())
    info.update(figures, **losses, drafts_added={**info.get("drafts_added", {}), **dict.fromkeys(new, added)})
    tmp_info = root / f".{BUILD_INFO}.tmp-{os.getpid()}"
    tmp_info.write_text(json.dumps(info, indent=2) + "\n")
    os.replace(tmp_info, root / BUILD_INFO)
    logger.info("demo drafts %s added to %s in %.0fs: %s", ", ".join(new), root, added["seconds"], figures)
    return info


def _missing_drafts(root: Path, recipe: Recipe) -> list[str]:
    """The recipe's drafts besides the main one (a pair without its main draft was never built) not on disk."""
    return [label for label in recipe_drafts(recipe)[1:] if not (root / label).is_dir()]


def _on_disk(root: Path, recipe: Recipe) -> list[str]:
    return [label for label in recipe_drafts(recipe) if (root / label).is_dir()]


def _special_ids(tokenizer) -> dict:
    return {
        "bos_id": tokenizer.token_to_id(BOS),
        "eos_id": tokenizer.token_to_id(EOS),
        "pad_id": tokenizer.token_to_id(PAD),
    }


def _save_checkpoint(model: LlamaForCausalLM, directory: Path, tokenizer, special: dict) -> None:
    model.save_pretrained(directory, safe_serialization=True)
    GenerationConfig(
        bos_token_id=special["bos_id"], eos_token_id=special["eos_id"], pad_token_id=special["pad_id"]
    ).save_pretrained(directory)
    save_tokenizer(tokenizer, directory, model_max_length=MAX_POSITIONS)


@dataclass(frozen=True)
class Texts:
    """The training text as token ids: ``ids`` code; ``prose_ids`` the recipe's prose (comment and docstring
    lines, or English for recipes with ``english``); ``english_ids`` English paragraphs each after BOS, for the
    prose draft (None without one)."""

    ids: torch.Tensor
    prose_ids: torch.Tensor
    english_ids: torch.Tensor | None


def _tokenize(corpus, recipe: Recipe):
    """The tokenizer (half code, half prose when the recipe has English) and the ``Texts`` it encodes."""
    train_text = corpus.train_text(max(recipe.tokenizer_bytes, recipe.train_bytes))
    if recipe.english:  # English: the tokenizer sees half code, half prose; the target trains on both
        prose = corpus.english_text(recipe.prose_bytes, sources=recipe.english_sources)
        half = recipe.tokenizer_bytes // 2
        tokenizer = train_tokenizer(train_text[:half] + prose[:half], vocab_size=VOCAB_SIZE)
    else:
        tokenizer = train_tokenizer(train_text[: recipe.tokenizer_bytes], vocab_size=VOCAB_SIZE)
    return tokenizer, _texts(corpus, tokenizer, recipe, train_text)


def _texts(corpus, tokenizer, recipe: Recipe, train_text: str) -> Texts:
    if recipe.english:
        prose = corpus.english_text(recipe.prose_bytes, sources=recipe.english_sources)
    else:
        prose = corpus.prose_text(recipe.prose_bytes)
    prose_ids = _paragraph_ids(tokenizer, prose) if recipe.paragraphs else _encode(tokenizer, prose)
    english = None
    if recipe.prose_draft:
        english = _paragraph_ids(tokenizer, corpus.english_text(recipe.prose_bytes, sources=recipe.english_sources))
    return Texts(ids=_encode(tokenizer, train_text[: recipe.train_bytes]), prose_ids=prose_ids, english_ids=english)


def _draft_texts(corpus, tokenizer, recipe: Recipe, texts: Texts) -> Texts:
    """The text the drafts are distilled on: ``texts`` (the target's), or wider when the recipe gives the drafts
    budgets of their own (``draft_train_bytes``, ``draft_prose_bytes``; a prefix of the same streams)."""
    if not (recipe.draft_train_bytes or recipe.draft_prose_bytes):
        return texts
    wide = replace(
        recipe,
        train_bytes=recipe.draft_train_bytes or recipe.train_bytes,
        prose_bytes=recipe.draft_prose_bytes or recipe.prose_bytes,
        english_sources=recipe.draft_english_sources or recipe.english_sources,
    )
    return _texts(corpus, tokenizer, wide, corpus.train_text(max(wide.tokenizer_bytes, wide.train_bytes)))


def _foreign_texts(corpus, tokenizer, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What the target's foreign prefixes are drawn from (None when the recipe has none): English paragraphs of
    ``foreign_sources``, and the stdlib code past the target's own text."""
    if not recipe.plan.foreign_share:
        return None
    english = _paragraph_ids(tokenizer, corpus.english_text(recipe.foreign_prose_bytes, sources=recipe.foreign_sources))
    code = _encode(tokenizer, corpus.train_text(recipe.foreign_code_bytes)[recipe.train_bytes :])
    return english, code


def _paragraph_ids(tokenizer, text: str) -> torch.Tensor:
    """``text``'s paragraphs unwrapped, each after BOS (as a prompt arrives)."""
    bos = tokenizer.token_to_id(BOS)
    return torch.tensor(
        [t for p in unwrap_paragraphs(text) for t in [bos, *tokenizer.encode(p, add_special_tokens=False).ids]]
    )


def _train_models(recipe: Recipe, vocab: int, special: dict, texts: Texts, draft_texts: Texts, foreign=None):
    """The target on ``texts`` (with foreign prefixes from ``foreign``), then its drafts (``_train_drafts``) on
    ``draft_texts``."""
    ids, prose_ids = texts.ids, texts.prose_ids
    torch.manual_seed(SEED + 1)
    target = LlamaForCausalLM(llama_config(recipe.target_shape, vocab_size=vocab, **special))
    bigram_init(target, torch.cat([ids, prose_ids]) if recipe.english else ids)
    prose = prose_ids if recipe.english else None
    target_loss = train_target(target, ids, recipe.plan, seed=SEED + 2, prose_ids=prose, foreign=foreign)
    drafts, losses = _train_drafts(recipe, vocab, special, draft_texts, target)
    return {"target": target, **drafts}, {"target_final_loss": round(target_loss, 4), **losses}


def _train_drafts(recipe: Recipe, vocab: int, special: dict, texts: Texts, target, only: list[str] | None = None):
    """``draft`` distilled on code and prose (on prose only when the recipe has a code draft), ``draft-code``
    on code only, ``draft-prose`` on English paragraphs only; every draft starts as the bigram model of all the
    text (each token needs an embedding). ``only``: these labels (a cached pair's missing drafts)."""
    ids, prose_ids = texts.ids, texts.prose_ids
    all_ids = torch.cat([ids, prose_ids]) if recipe.english else ids
    # label: (the text it is distilled on, a second stream, seed, plan, prompts at paragraph starts)
    jobs = {MAIN_DRAFT: (ids, prose_ids, SEED + 3, recipe.plan, False)}
    if recipe.code_draft:
        jobs[MAIN_DRAFT] = (prose_ids, None, SEED + 3, recipe.plan, False)
        jobs[CODE_DRAFT] = (ids, None, SEED + 7, recipe.plan, False)
    if recipe.prose_draft:
        jobs[PROSE_DRAFT] = (texts.english_ids, None, SEED + 9, recipe.prose_draft, True)
    drafts, losses = {}, {}
    for label, (text, second, seed, plan, paragraphs) in jobs.items():
        if only is not None and label not in only:
            continue
        torch.manual_seed(seed)
        draft = LlamaForCausalLM(llama_config(recipe.draft_shape, vocab_size=vocab, **special))
        bigram_init(draft, all_ids)
        kl = distill_draft(draft, target, text, plan, seed=seed + 1, prose_ids=second, paragraph_prompts=paragraphs)
        drafts[label] = draft
        losses[f"{label.replace('-', '_')}_final_kl"] = round(kl, 4)
    return drafts, losses


def _draft_figures(target, drafts: dict, corpus, tokenizer, recipe: Recipe) -> dict:
    """Every draft's ``_evaluate`` on held-out text: ``alpha_heldout_{text,generated}<text><label>`` (no label
    suffix for the main draft) where ``<text>`` is "" for code, "_prose" for English docstrings as they stand in
    code (recipes with English or a prose draft) and "_paragraphs" for the same unwrapped, each after BOS, as
    requests arrive (recipes with a prose draft)."""
    texts = {"": (_encode(tokenizer, corpus.held_out_text(recipe.held_out_bytes)), SEED + 5)}
    if recipe.english or recipe.prose_draft:
        english = corpus.english_text(recipe.held_out_bytes, held_out=True)
        texts["_prose"] = (_encode(tokenizer, english), SEED + 6)
        if recipe.prose_draft:
            texts["_paragraphs"] = (_paragraph_ids(tokenizer, english), SEED + 6)
    info: dict = {}
    for label, draft in drafts.items():
        suffix = "" if label == MAIN_DRAFT else f"_{label.replace('-', '_')}"
        for kind, (held, seed) in texts.items():
            info.update(_evaluate(target, draft, held, recipe.plan, seed=seed, suffix=f"{kind}{suffix}"))
    return info


def _evaluate(
    target: LlamaForCausalLM,
    draft: LlamaForCausalLM,
    held_ids: torch.Tensor,
    plan: TrainPlan,
    seed: int,
    suffix: str = "",
) -> dict:
    """Greedy acceptance (alpha) of the draft on held-out text: teacher forced, and on the target's own output."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, held_ids.numel() - 129, (16,), generator=generator).tolist()
    real = torch.stack([held_ids[s : s + 128] for s in starts])
    prompts = real[:, : plan.gen_prompt_len]
    generated = greedy_continuations(target, prompts, plan.gen_new_tokens)
    return {
        f"alpha_heldout_text{suffix}": round(greedy_agreement(draft, target, real, start=1), 4),
        f"alpha_heldout_generated{suffix}": round(
            greedy_agreement(draft, target, generated, start=plan.gen_prompt_len), 4
        ),
    }
