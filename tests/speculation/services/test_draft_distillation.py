"""Draft distillation on an endpoint's captured traffic: a training run of kind draft_model continues from a
registered draft model, saves a loadable draft that joins the endpoint's candidates and records what it was trained
on; a draft of another tokenizer and another team's captures are refused (400 REST, exit code 2 CLI)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError
from django.core.management import CommandError, call_command

from fleet.models import Endpoint
from fleet.permissions import ADMIN
from speculation.models import CaptureSetting, DraftKind, TrainingKind, TrainingRun, TrainingStatus
from speculation.selectors.drafts import drafts_usable_by
from speculation.services import captures
from speculation.services.autopairing import trained_on
from speculation.services.draft_distillation import create_distillation_run
from speculation.services.drafts import register_draft
from speculation.services.training_runs import run_training
from tests.support.users import api_as, make_user

pytestmark = pytest.mark.django_db

WORDS = "return the value of a file path when the list is empty and raise an error for each new item".split()
# Each workload's answer: a fixed phrase the shipped draft does not predict, so that learning it shows.
ANSWERS = {"chat": " Sure: the list is empty, so raise an error.", "code": " return [item for item in items if item]"}
OPTIONS = {"held_out": 0.25, "new_tokens": 10, "batch_size": 6, "warmup_steps": 1, "eval_k": 4, "lr": 3e-3}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def red() -> Group:
    return Group.objects.get_or_create(name="red")[0]


@pytest.fixture
def demo_draft(demo_pair, red):
    return register_draft(name="demo-draft", kind=DraftKind.DRAFT_MODEL, path=str(demo_pair.draft_dir), team=red)


@pytest.fixture
def endpoint(demo_pair, red) -> Endpoint:
    """A red-team endpoint that captured 24 requests, half "chat", half "code", each answered with its phrase."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(demo_pair.draft_dir))
    endpoint = Endpoint.objects.create(name="captured", base_url="http://127.0.0.1:9", kind="vllm", team=red)
    CaptureSetting.objects.create(endpoint=endpoint, enabled=True, sample_rate=1.0)
    rows = []
    for i in range(24):
        workload = ("chat", "code")[i % 2]
        prompt = tokenizer(" ".join(WORDS[i % 9 :][:5]).capitalize() + f" {i}")["input_ids"]
        output = tokenizer(ANSWERS[workload], add_special_tokens=False)["input_ids"][:10]
        rows.append(dict(endpoint_id=endpoint.pk, workload=workload, mode="shadow", prompt_ids=prompt,
                         output_ids=output, greedy=True))  # fmt: skip
    captures.write_captures(rows)
    return endpoint


def test_it_distils_a_draft_that_joins_the_endpoints_candidates(tmp_path, endpoint, demo_draft, monkeypatch):
    from transformers import AutoModelForCausalLM

    from speculation.worker import candidates

    replayed: list[str] = []
    monkeypatch.setattr(candidates, "measure_candidates", lambda **job: replayed.append(job["request_id"]))
    # given a team admin's distillation run of the shipped draft on the endpoint's captures
    admin = make_user("red-admin", ADMIN, teams=("red",))
    run = create_distillation_run(draft="demo-draft", out_dir=str(tmp_path / "distilled"), prompts="captured:captured",
                                  epochs=3, options=OPTIONS, owner=admin)  # fmt: skip
    assert (run.kind, run.prompts, run.team.name) == (TrainingKind.DRAFT_MODEL, f"captured:{endpoint.pk}", "red")
    # when the training task runs it
    run = run_training(run=run)
    # then it registered a loadable draft model of the team: one of the endpoint's auto-pairing candidates
    assert run.status == TrainingStatus.DONE and run.epoch >= 1 and run.log
    draft = run.draft
    assert draft.kind == DraftKind.DRAFT_MODEL and draft.team.name == "red"
    assert drafts_usable_by(endpoint).filter(pk=draft.pk).exists()
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {p.name for p in Path(draft.path).iterdir()}
    assert AutoModelForCausalLM.from_pretrained(draft.path).config.vocab_size == draft.vocab_size
    # and it says what it was trained on, continued from which draft
    assert trained_on(draft) == f"training run {run.pk} on captured:{endpoint.pk}, continued from demo-draft"
    # and on the held-out captures (the 3 oldest of each workload) it is not below the draft it started from.
    # Tolerance 0: the replay is greedy and seeded (no sampling noise), and the held-out answers are the phrases it
    # trained on, so a draft that learnt nothing, or unlearnt, fails this.
    facts = draft.config["distillation"]
    assert facts["mean_accepted_len"] >= facts["original_mean_accepted_len"]
    assert facts["mean_accepted_len"] > facts["original_mean_accepted_len"] + 0.5, facts
    assert run.mean_accepted_len == facts["mean_accepted_len"]
    # and the held-out captures were replayed with every candidate
    assert len(replayed) == 6


def test_a_draft_of_another_tokenizer_is_refused_naming_it(tmp_path, endpoint, demo_draft):
    endpoint.capabilities = {"tokenizer_fingerprint": "f-other"}
    endpoint.save(update_fields=["capabilities"])
    with pytest.raises(ValidationError) as caught:
        create_distillation_run(draft="demo-draft", out_dir=str(tmp_path / "d"), prompts="captured:captured")
    assert "tokenizer" in caught.value.message_dict["init_from"][0]
    assert "f-other" in caught.value.message_dict["init_from"][0]
    assert not TrainingRun.objects.exists()


def test_a_policy_target_of_another_vocabulary_is_refused(tmp_path, endpoint, demo_draft, tiny_model_dir):
    from speculation.models import SpeculationPolicy

    SpeculationPolicy.objects.create(endpoint=endpoint, target_path=str(tiny_model_dir))
    with pytest.raises(ValidationError) as caught:
        create_distillation_run(draft="demo-draft", out_dir=str(tmp_path / "d"), prompts="captured:captured")
    assert "vocabulary" in caught.value.message_dict["init_from"][0]


def test_another_teams_admin_may_not_distil_on_its_captures(tmp_path, endpoint, demo_draft):
    blue = make_user("blue-admin", ADMIN, teams=("blue",))
    response = api_as(blue).post("/api/v1/training-runs/", {
        "kind": "draft_model", "init_from": str(demo_draft.path), "out_dir": str(tmp_path / "d"),
        "prompts": f"captured:{endpoint.pk}",
    }, format="json")  # fmt: skip
    assert response.status_code == 400
    assert "no endpoint whose captured traffic you may use" in response.json()["prompts"][0]
    assert not TrainingRun.objects.exists()


def test_the_api_queues_a_distillation_run_and_refuses_a_mismatch(tmp_path, endpoint, demo_draft):
    client = api_as(make_user("red-admin", ADMIN, teams=("red",)))
    body = {"kind": "draft_model", "init_from": "demo-draft", "out_dir": str(tmp_path / "d"),
            "prompts": "captured:captured:code", "epochs": 2}  # fmt: skip
    response = client.post("/api/v1/training-runs/", body, format="json")
    assert response.status_code == 201, response.json()
    assert (response.json()["kind"], response.json()["prompts"]) == ("draft_model", f"captured:{endpoint.pk}:code")
    Endpoint.objects.filter(pk=endpoint.pk).update(capabilities={"tokenizer_fingerprint": "f-other"})
    response = client.post("/api/v1/training-runs/", {**body, "out_dir": str(tmp_path / "e")}, format="json")
    assert response.status_code == 400 and "tokenizer" in response.json()["init_from"][0]


@pytest.mark.parametrize("prompts", ["spec_bench", "captured:captured,spec_bench", ""])
def test_a_distillation_run_trains_on_captured_traffic_only(tmp_path, endpoint, demo_draft, prompts):
    with pytest.raises(ValidationError) as caught:
        create_distillation_run(draft="demo-draft", out_dir=str(tmp_path / "d"), prompts=prompts)
    assert "captured" in caught.value.message_dict["prompts"][0]


def test_the_command_line_exits_2_on_a_mismatched_draft(tmp_path, endpoint, demo_draft):
    endpoint.capabilities = {"tokenizer_fingerprint": "f-other"}
    endpoint.save(update_fields=["capabilities"])
    args = ["--draft", "demo-draft", "--out", str(tmp_path / "d"), "--prompts", "captured:captured"]
    with pytest.raises(CommandError) as caught:
        call_command("distill_draft", *args, stdout=io.StringIO())
    assert caught.value.returncode == 2 and "tokenizer" in str(caught.value)


def test_on_the_targets_own_answers_the_distilled_draft_is_not_below_the_shipped_one(
    tmp_path, demo_pair, red, demo_draft, monkeypatch
):
    """The shipped draft was distilled from this target already, so here there is little to gain: the check is that a
    gentle fine-tune (the default learning rate) on the target's greedy answers does not lose held-out acceptance.
    Tolerance 0.05 tokens per step: six held-out answers of 10 tokens are some 30 verification steps, where one step
    more or less moves the mean by ~0.1; the kept epoch is the best of the run's, so a real loss still fails."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from speculation.worker import candidates

    monkeypatch.setattr(candidates, "measure_candidates", lambda **job: None)
    tokenizer = AutoTokenizer.from_pretrained(str(demo_pair.target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(demo_pair.target_dir)).eval()
    endpoint = Endpoint.objects.create(name="served", base_url="http://127.0.0.1:9", kind="vllm", team=red)
    CaptureSetting.objects.create(endpoint=endpoint, enabled=True, sample_rate=1.0)
    rows = []
    for i in range(24):
        prompt = tokenizer(" ".join(WORDS[i % 9 :][:5]).capitalize() + f" {i}")["input_ids"]
        with torch.no_grad():
            answer = target.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        rows.append(dict(endpoint_id=endpoint.pk, workload=("chat", "code")[i % 2], mode="shadow", prompt_ids=prompt,
                         output_ids=answer[0, len(prompt) :].tolist(), greedy=True))  # fmt: skip
    captures.write_captures(rows)
    options = {key: value for key, value in OPTIONS.items() if key != "lr"}
    run = create_distillation_run(draft="demo-draft", out_dir=str(tmp_path / "d"), prompts="captured:served",
                                  epochs=2, options=options)  # fmt: skip
    facts = run_training(run=run).draft.config["distillation"]
    assert facts["mean_accepted_len"] >= facts["original_mean_accepted_len"] - 0.05, facts


def test_the_drafts_page_shows_a_distillation_run_with_its_progress(tmp_path, endpoint, demo_draft):
    from django.urls import reverse

    from tests.support.users import browser_as

    admin = make_user("red-admin", ADMIN, teams=("red",))
    run = create_distillation_run(draft="demo-draft", out_dir=str(tmp_path / "d"), prompts="captured:captured",
                                  epochs=4, owner=admin)  # fmt: skip
    TrainingRun.objects.filter(pk=run.pk).update(status=TrainingStatus.RUNNING, stage="train", epoch=2)
    body = browser_as(admin).get(reverse("speculation:draft-list")).content.decode()
    assert f'data-run="{run.pk}"' in body and "2/4" in body
    assert f"draft distillation on <code>captured:{endpoint.pk}</code>" in body


def test_a_distillation_run_needs_a_draft_model_named(tmp_path, endpoint, demo_draft):
    client = api_as(make_user("red-admin", ADMIN, teams=("red",)))
    body = {"kind": "draft_model", "out_dir": str(tmp_path / "d"), "prompts": "captured:captured"}
    response = client.post("/api/v1/training-runs/", body, format="json")
    assert response.status_code == 400 and "name the draft model" in response.json()["init_from"][0]
    response = client.post("/api/v1/training-runs/", {**body, "init_from": "no-such-draft"}, format="json")
    assert response.status_code == 400 and "neither a registered draft model" in response.json()["init_from"][0]


def test_hourly_retraining_does_not_repeat_a_distillation_run(tmp_path, endpoint, demo_draft):
    from datetime import timedelta

    from django.utils import timezone

    from speculation.services.capture_retraining import due

    run = create_distillation_run(draft="demo-draft", out_dir=str(tmp_path / "d"), prompts="captured:captured")
    an_hour_ago = timezone.now() - timedelta(hours=1)
    TrainingRun.objects.filter(pk=run.pk).update(status=TrainingStatus.DONE, finished_at=an_hour_ago)
    TrainingRun.objects.filter(pk=run.pk).update(kind=TrainingKind.EAGLE_HEAD)
    assert [r.pk for r in due(min_new=1)] == [run.pk]  # the 24 captures are newer: an EAGLE run would be due
    TrainingRun.objects.filter(pk=run.pk).update(kind=TrainingKind.DRAFT_MODEL)
    assert due(min_new=1) == []
