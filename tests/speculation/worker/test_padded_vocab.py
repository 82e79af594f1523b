"""A draft and a target of one tokenizer whose checkpoints pad the vocabulary to different sizes (as Qwen's do), where
the worker loads them: prod's proposer, shadow's greedy replay width and its sampled acceptance read the draft over
the tokenizer's ids."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch

from speculation import drafting
from speculation.engine.sampling import SamplingParams
from speculation.worker import sampled
from speculation.worker.paths import resources
from tests.support.families import first_layer_draft


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(resources, "_loaded", OrderedDict())


@pytest.fixture(scope="module")
def padded(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path]:
    """(target, draft): the tiny model's first layer padded to 320 and to 310 ids, one tokenizer."""
    target = first_layer_draft(tiny_model_dir, tmp_path_factory.mktemp("padded-target"), vocab=320)
    draft = first_layer_draft(tiny_model_dir, tmp_path_factory.mktemp("padded-draft"), vocab=310)
    return target, draft


class _Policy:
    def __init__(self, draft_dir: Path) -> None:
        self.draft = type("Draft", (), {"path": str(draft_dir), "name": "padded"})()


def test_it_drafts_among_the_tokenizers_ids_against_a_target_padded_otherwise(fresh, padded):
    target_dir, draft_dir = padded
    draft = resources.model(str(draft_dir))
    tokens = len(draft.tokenizer)
    assert tokens < 310
    # shadow's greedy replay drafts among the tokenizer's ids against that target (its size read from its config,
    # the target not loaded for it), and with the whole vocabulary against a server
    assert resources.draft_width(draft, str(target_dir)) == tokens
    assert str(target_dir) not in resources._loaded
    assert resources.draft_width(draft) == 310
    # prod's local path: the proposer reads the tokenizer's ids and drafts over the target's
    setup = drafting.for_kind("draft_model").proposer(_Policy(draft_dir), resources.model(str(target_dir)))
    assert (setup.proposer.width, setup.vocab_size) == (tokens, 320)


def test_shadow_reads_a_padded_drafts_sampled_acceptance_over_the_targets_ids(fresh, padded):
    target_dir, draft_dir = padded
    prompt, output = [1, 40, 41, 42], [43, 44, 45, 46, 47]
    params = SamplingParams(temperature=1.0)
    view = sampled.target_view(endpoint=None, target_path=str(target_dir), prompt_ids=prompt, output_ids=output,
                               params=params)  # fmt: skip
    logits = sampled.draft_logits(view, str(draft_dir), prompt, output)
    tokens = len(resources.model(str(draft_dir)).tokenizer)
    assert logits.shape == (len(output), 320) and torch.isinf(logits[:, tokens:]).all()
    alpha = sampled.draft_acceptance(view, str(draft_dir), prompt, output).alpha
    assert 0.0 < alpha <= 1.0
