"""The demo target's EAGLE head is built for whatever demo version is in use, once, and never seen half-written."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from speculation.offline.demo.build import DemoPair
from speculation.offline.eagle.demo_head import EAGLE3, build_demo_head, eagle_proposer_for


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    words = "the quick brown fox jumps over the lazy dog".split()
    lines = [{"category": ("fox", "dog")[i % 2], "prompt": " ".join(words[i % 5 :] + words[: i % 5])} for i in range(8)]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


def test_the_head_is_built_for_the_pairs_target_once_with_its_build_time(tmp_path, tiny_model_dir, prompt_file):
    from speculation.engine import load_causal_lm

    pair = DemoPair(root=tiny_model_dir.parent, target_dir=tiny_model_dir, draft_dir=tiny_model_dir)
    settings = replace(EAGLE3, prompts=str(prompt_file), max_prompts=0, new_tokens=8, text_windows=0,
                       train=replace(EAGLE3.train, epochs=1, batch_size=4))  # fmt: skip
    out = tmp_path / "models" / "demo-vX-eagle"

    built = build_demo_head(pair, out=out, settings=settings)

    trained = json.loads((out / "config.json").read_text())["ace_eagle"]["trained"]
    assert built == out and trained["build_s"] > 0 and trained["unroll"] == 2
    assert not (out / "_work").exists() and not list(out.parent.glob("*.work"))  # work files gone
    target = load_causal_lm(tiny_model_dir)
    assert eagle_proposer_for(pair, target, out) is not None  # it loads for that target
    # a second call finds it and trains nothing
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert build_demo_head(pair, out=out, settings=settings) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_head_for_an_earlier_build_of_the_target_is_not_used(tmp_path, tiny_model_dir):
    import torch

    from speculation.engine import load_causal_lm
    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights

    pair = DemoPair(root=tiny_model_dir.parent, target_dir=tiny_model_dir, draft_dir=tiny_model_dir)
    config = replace(EagleConfig.for_target(tiny_model_dir), target_fingerprint="0" * 32)  # another build's
    head = EagleHead(config)
    init_weights(head, torch.Generator().manual_seed(0))
    head.save(tmp_path / "stale")

    assert eagle_proposer_for(pair, load_causal_lm(tiny_model_dir), tmp_path / "stale") is None
