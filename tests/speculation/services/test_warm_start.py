"""A training run that continues from a saved EAGLE head (warm start): it starts from that head's weights in its own
format, records the head it continued from (the run's config and the change history), and refuses a head that does
not fit the run, naming why (400 in REST, exit code 2 on the command line, nothing recorded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.core.management import call_command
from django.core.management.base import CommandError
from safetensors.torch import load_file

from fleet.models import Endpoint
from speculation.engine.eagle_format import FORMAT_MULTI_LAYER, head_format, read_config
from speculation.models import CaptureSetting, DraftKind, DraftModel, SpeculationPolicy, TrainingRun
from speculation.offline.eagle.demo_head import default_head_dir
from speculation.offline.eagle.settings import PipelineSettings
from speculation.offline.eagle.warm_start import WARM_START_LR
from speculation.services import captures
from speculation.services.autopairing import trained_on
from speculation.services.capture_retraining import retrain
from speculation.services.eagle_training import create_training_run, run_training

pytestmark = pytest.mark.django_db

# the shipped head's own recipe (multi-layer, two drafting steps), a few short captured requests
OPTIONS = {"multi_layer": True, "unroll": 2, "new_tokens": 8, "held_out": 0.25, "batch_size": 4, "warmup_steps": 2}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def shipped(demo_pair, tmp_path) -> DraftModel:
    """The demo target's shipped head (format 2), registered as `served-head`."""
    directory = tmp_path / "served-head"
    shutil.copytree(default_head_dir(demo_pair), directory)
    return DraftModel.objects.create(name="served-head", kind=DraftKind.EAGLE_HEAD, path=str(directory))


@pytest.fixture
def endpoint() -> Endpoint:
    """An endpoint of the red team with 16 captured requests (token ids inside the demo target's vocabulary)."""
    endpoint = Endpoint.objects.create(
        name="captured", base_url="http://127.0.0.1:9", kind="vllm", team=Group.objects.get_or_create(name="red")[0]
    )
    CaptureSetting.objects.create(endpoint=endpoint, enabled=True, sample_rate=1.0)
    generator = torch.Generator().manual_seed(0)
    rows = [dict(endpoint_id=endpoint.pk, workload="code", mode="off", greedy=True,
                 prompt_ids=torch.randint(3, 2000, (10,), generator=generator).tolist(),
                 output_ids=torch.randint(3, 2000, (8,), generator=generator).tolist()) for _ in range(16)]  # fmt: skip
    captures.write_captures(rows)
    return endpoint


def _run(demo_pair, tmp_path, endpoint, **fields) -> TrainingRun:
    return create_training_run(target_dir=str(demo_pair.target_dir), out_dir=str(tmp_path / "head"),
                               prompts=f"captured:{endpoint.pk}", epochs=1, name="warm", **fields)  # fmt: skip


def test_it_starts_from_the_heads_weights_in_its_format_and_records_the_head(demo_pair, tmp_path, endpoint, shipped):
    # given a run continuing from the registered head at learning rate 0 (the weights cannot move)
    run = _run(demo_pair, tmp_path, endpoint, options={**OPTIONS, "lr": 0.0}, init_from="served-head")
    # when it trains
    run = run_training(run=run)
    # then the head it saved holds the starting head's weights, in the starting head's format (2, not EAGLE-3's 3)
    start, saved = (load_file(str(Path(d) / "model.safetensors")) for d in (shipped.path, run.out_dir))
    assert start.keys() == saved.keys() and all(torch.equal(start[k], saved[k]) for k in start)
    assert head_format(read_config(run.out_dir)) == FORMAT_MULTI_LAYER
    # and the run, its head and the change history say which head it continued from
    assert run.config["init_from"] == str(Path(shipped.path).resolve())
    assert read_config(run.out_dir)["ace_eagle"]["trained"]["init_from"] == run.config["init_from"]
    assert trained_on(run.draft) == f"training run {run.pk} on captured:{endpoint.pk}, continued from served-head"


def test_it_trains_at_the_warm_start_rate_unless_one_is_given(demo_pair, tmp_path, endpoint, shipped):
    warm = _run(demo_pair, tmp_path, endpoint, options=OPTIONS, init_from=str(shipped.path))
    scratch = create_training_run(target_dir=str(demo_pair.target_dir), out_dir=str(tmp_path / "new"),
                                  prompts=f"captured:{endpoint.pk}", options=OPTIONS)  # fmt: skip

    assert PipelineSettings.from_dict(warm.config).train.lr == WARM_START_LR
    assert PipelineSettings.from_dict(scratch.config).train.lr == 4 * WARM_START_LR
    assert PipelineSettings.from_dict(scratch.config).init_from == ""


def _other_target_head(shipped: DraftModel, tmp_path: Path) -> Path:
    directory = tmp_path / "other-head"
    shutil.copytree(shipped.path, directory)
    config = json.loads((directory / "config.json").read_text())
    config["ace_eagle"].update(target_name="other/target", target_fingerprint="0" * 32, hidden_size=512)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_a_head_that_does_not_fit_the_run_is_refused_naming_the_mismatch(demo_pair, tmp_path, endpoint, shipped):
    single_layer = {k: v for k, v in OPTIONS.items() if k != "multi_layer"}
    cases = [
        ("served-head", single_layer, "a multi-layer head (format 2) for a single-layer recipe"),
        (str(_other_target_head(shipped, tmp_path)), OPTIONS, "trained for target 'other/target'"),
        (str(_other_target_head(shipped, tmp_path / "b")), OPTIONS, "hidden size 512 (the target's: 256)"),
        ("no-such-head", OPTIONS, "neither a registered EAGLE head you may use nor a directory under the model roots"),
    ]
    for init_from, options, says in cases:
        with pytest.raises(ValidationError) as refused:
            _run(demo_pair, tmp_path, endpoint, options=options, init_from=init_from)
        assert says in refused.value.message_dict["init_from"][0], (init_from, refused.value.message_dict)
    assert not TrainingRun.objects.exists()


def test_rest_answers_400_naming_init_from(api, demo_pair, tmp_path, shipped):
    body = {"target_dir": str(demo_pair.target_dir), "out_dir": str(tmp_path / "head"),
            "init_from": str(_other_target_head(shipped, tmp_path))}  # fmt: skip

    response = api.post("/api/v1/training-runs/", body, format="json")

    assert response.status_code == 400 and "trained for target" in response.json()["init_from"][0]
    assert not TrainingRun.objects.exists()


def test_the_command_line_exits_2_on_a_head_that_does_not_fit(demo_pair, tmp_path, endpoint, shipped):
    with pytest.raises(CommandError) as refused:  # a multi-layer head without --multi-layer
        call_command("train_eagle", "--target", str(demo_pair.target_dir), "--out", str(tmp_path / "head"),
                     "--prompts", f"captured:{endpoint.pk}", "--init-from", "served-head")  # fmt: skip

    assert refused.value.returncode == 2 and "single-layer recipe" in str(refused.value)
    assert not TrainingRun.objects.exists()


def test_a_retrain_continues_from_the_head_the_endpoint_drafts_with(demo_pair, tmp_path, endpoint, shipped):
    # given a finished run on the endpoint's captures and the endpoint drafting with the served head
    first = _run(demo_pair, tmp_path, endpoint, options=OPTIONS)
    TrainingRun.objects.filter(pk=first.pk).update(status="done")
    SpeculationPolicy.objects.create(endpoint=endpoint, mode="prod", mechanism="eagle_head", draft=shipped, k=3)
    # when it is repeated on new captures
    repeat = retrain(first)
    # then the repeat continues from that head at the warm-start rate, its other settings kept
    settings = PipelineSettings.from_dict(repeat.config)
    assert settings.init_from == str(Path(shipped.path).resolve()) and settings.train.lr == WARM_START_LR
    assert settings.multi_layer and settings.train.unroll == 2


def test_a_retrain_starts_from_scratch_when_the_endpoints_head_does_not_fit(demo_pair, tmp_path, endpoint, shipped):
    first = _run(demo_pair, tmp_path, endpoint, options={k: v for k, v in OPTIONS.items() if k != "multi_layer"})
    TrainingRun.objects.filter(pk=first.pk).update(status="done")
    SpeculationPolicy.objects.create(endpoint=endpoint, mode="prod", mechanism="eagle_head", draft=shipped, k=3)

    repeat = retrain(first)  # a single-layer run; the endpoint's head is multi-layer

    settings = PipelineSettings.from_dict(repeat.config)
    assert settings.init_from == "" and settings.train.lr == 4 * WARM_START_LR
