"""Tiny seeded models for the engine tests (built in the test, no checkpoint needed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from speculation.engine import Transformer
from tests.support.models import draft_of, tiny_model


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models run faster on one thread, and a shared machine does not stall the thread barrier."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target_model() -> Transformer:
    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def draft_model(target_model: Transformer) -> Transformer:
    return draft_of(target_model)


@pytest.fixture(scope="session")
def make_tiny_model():
    return tiny_model
