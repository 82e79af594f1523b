"""The worker loads models on the device and in the dtype its settings name (ACE_ENGINE_DEVICE, ACE_ENGINE_DTYPE)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from speculation.worker.paths import resources


@pytest.fixture
def fresh(monkeypatch):
    """No model loaded yet in this process (the worker's cache is per process)."""
    monkeypatch.setattr(resources, "_loaded", OrderedDict())


def test_it_loads_models_in_the_dtype_the_settings_name(settings, fresh, tiny_model_dir):
    # given a worker set to bfloat16 on the CPU (auto would be float32 there)
    settings.ENGINE_DEVICE, settings.ENGINE_DTYPE = "cpu", "bfloat16"
    # when it loads a float32 checkpoint
    model = resources.model(str(tiny_model_dir)).model
    # then: the weights are bfloat16
    assert model.output.weight.dtype == torch.bfloat16


def test_it_loads_float32_on_the_cpu_by_default(settings, fresh, tiny_model_dir):
    settings.ENGINE_DEVICE, settings.ENGINE_DTYPE = "cpu", "auto"
    assert resources.placement() == ("cpu", None)
    assert resources.model(str(tiny_model_dir)).model.output.weight.dtype == torch.float32


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_it_refuses_a_cuda_device_where_there_is_none_naming_the_setting(settings, fresh, tiny_model_dir):
    settings.ENGINE_DEVICE = "cuda"
    with pytest.raises(RuntimeError, match="ACE_ENGINE_DEVICE=cuda"):
        resources.model(str(tiny_model_dir))
