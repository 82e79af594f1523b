"""Fixtures of the worker's tests."""

from __future__ import annotations

import pytest
import redis
import torch


@pytest.fixture
def client(redis_server):
    """A client of the test session's real Redis (the broker and the gateway-worker channel)."""
    found = redis.Redis.from_url(redis_server.url)
    yield found
    found.close()


@pytest.fixture
def other_model_dir(tiny_model_dir, tmp_path):
    """The tiny model with perturbed weights (same tokenizer): a target that differs from the draft."""
    import shutil

    from transformers import LlamaForCausalLM

    out = tmp_path / "tiny-target"
    shutil.copytree(tiny_model_dir, out)
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5 * param.std())
    model.save_pretrained(out)
    return out
