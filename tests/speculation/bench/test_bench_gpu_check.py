"""The CUDA check (scripts/device/engine_gpu.sh, speculation.bench.gpu_check) runs as is: no GPU is needed here, so
its comparison is tried on the CPU (one family, a few tokens) and its refusal where there is no CUDA device."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from ace.processes import REPO_ROOT
from speculation.bench import gpu_check

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@no_cuda
def test_the_script_exits_2_saying_there_is_no_cuda_device():
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "scripts/device/engine_gpu.sh")], capture_output=True, text=True, timeout=120
    )

    assert result.returncode == 2
    assert "no CUDA device" in result.stderr


@no_cuda
def test_the_check_refuses_a_cuda_device_before_building_anything(capsys):
    assert gpu_check.main(["--device", "cuda:1", "--no-bench"]) == 2
    assert "--device cuda:1: torch sees no CUDA device" in capsys.readouterr().err


def test_it_compares_a_family_with_transformers_in_float32_and_bf16_on_the_cpu(tmp_path):
    # when one native and one generic family are checked on the CPU, one short prompt each
    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--family", "qwen3", "--family", "gpt_neox", "--prompts", "1", "--max-new-tokens", "6"]
    code = gpu_check.main([*argv, "--no-bench", "--json", str(out)])
    # then: both exact, float32 token for token and bf16 away from near-ties, and the JSON says so
    report = json.loads(out.read_text())
    assert code == 0, report
    qwen3, neox = report["families"]["qwen3"], report["families"]["gpt_neox"]
    assert (qwen3["implementation"], neox["implementation"]) == ("native", "generic")
    assert qwen3["float32"]["identical_prompts"] == 1 and qwen3["bfloat16"]["steps_differing"] == 0
    assert qwen3["bfloat16"]["steps_compared"] >= 3
