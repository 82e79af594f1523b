"""EAGLE heads, single- and multi-layer, trained for a target of every model family the engine runs, through the
training run that `manage.py train_eagle` and the Celery task both run (services.eagle_training.run_training); each
head loads beside its target in the engine and drafts, and decoding with it gives the target's own tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculation.engine import GenerationConfig, LocalTarget, generate, generate_plain, load_causal_lm
from speculation.engine.eagle import EagleProposer
from speculation.models import DraftKind, TrainingStatus
from speculation.offline.eagle.settings import PipelineSettings
from speculation.services.eagle_training import create_training_run, run_training
from tests.support.families import family_checkpoint

pytestmark = pytest.mark.django_db

FAMILIES = ("llama3", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
OPTIONS = {"max_prompts": 4, "new_tokens": 8, "held_out": 0.25, "batch_size": 4, "warmup_steps": 1}
PROMPT = [0, 1200, 5, 77, 640, 3, 18]


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    words = "def main ( ) : return the sum of every value in the list".split()
    lines = [{"category": ("a", "b")[i % 2], "prompt": " ".join(words[i:] + words[:i])} for i in range(8)]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_it_trains_single_and_multi_layer_heads_that_draft_for_a_target_of_the_family(
    family, tmp_path, demo_pair, prompt_file
):
    # given a 4-layer target of the family (the demo tokenizer)
    target_dir = family_checkpoint(tmp_path / "target", family, tokenizer_dir=demo_pair.target_dir)
    model = load_causal_lm(target_dir)
    target = LocalTarget(model)
    for multi_layer in (False, True):
        # when a training run trains a head for it
        options = {**OPTIONS, "multi_layer": multi_layer}
        run = create_training_run(target_dir=str(target_dir), out_dir=str(tmp_path / f"head-{multi_layer}"),
                                  prompts=str(prompt_file), epochs=1, options=options)  # fmt: skip
        run = run_training(run=run)
        # then: it is registered, reads the features asked for, and drafts the target's own tokens
        assert run.status == TrainingStatus.DONE and run.draft.kind == DraftKind.EAGLE_HEAD
        assert PipelineSettings.from_dict(run.config).multi_layer is multi_layer
        proposer = EagleProposer.from_dir(Path(run.out_dir), model, target_dir=target_dir)
        assert bool(proposer.head.config.feature_layers) is multi_layer
        config = GenerationConfig(max_new_tokens=16, k=3)
        result = generate(target, proposer, PROMPT, config)
        assert result.tokens == generate_plain(target, PROMPT, config).tokens, (family, multi_layer)
        assert result.stats.drafted_tokens > 0
