"""Training runs on an endpoint's captured traffic: the served outputs are the training sequences (pooled or one
workload's), for single- and multi-layer heads; only its team's admins may start one; nothing decrypted is written
to the run's directory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError

from fleet.models import Endpoint
from fleet.permissions import ADMIN, OPERATOR
from speculation.models import CaptureSetting, DraftKind, TrainingStatus
from speculation.offline.eagle.prompts import split_prompts
from speculation.offline.eagle.settings import PipelineSettings
from speculation.selectors.drafts import drafts_usable_by
from speculation.services import captures
from speculation.services.eagle_training import captured_sequences, create_training_run, run_training
from tests.support.users import make_user

pytestmark = pytest.mark.django_db

OPTIONS = {"new_tokens": 12, "held_out": 0.25, "batch_size": 4, "warmup_steps": 2}
# the token-led loss at a high rate: enough for a tiny random target's greedy answers in a few epochs
TRAIN = {"token_weight": 1.0, "lr": 1e-2}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


WORDS = "return the value of a file path when the list is empty and raise an error for each new item".split()


@pytest.fixture(scope="module")
def target_dir(demo_pair) -> Path:
    return demo_pair.target_dir


@pytest.fixture(scope="module")
def served(target_dir) -> list[tuple[list[int], list[int]]]:
    """24 docstring-like prompts and the demo target's greedy answers: what a vLLM serving it would have produced."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(target_dir)).eval()
    pairs = []
    for i in range(24):
        prompt = tokenizer(" ".join(WORDS[i % 7 :][:6]).capitalize() + f" {i}")["input_ids"]
        with torch.no_grad():
            answer = model.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
        pairs.append((prompt, answer[0, len(prompt) :].tolist()))
    return pairs


@pytest.fixture
def endpoint(served) -> Endpoint:
    """An endpoint of the red team that captured those 24 requests, half of workload "chat", half "code"."""
    endpoint = Endpoint.objects.create(
        name="captured", base_url="http://127.0.0.1:9", kind="vllm", team=Group.objects.get_or_create(name="red")[0]
    )
    CaptureSetting.objects.create(endpoint=endpoint, enabled=True, sample_rate=1.0)
    rows = [dict(endpoint_id=endpoint.pk, workload=("chat", "code")[i % 2], mode="shadow", prompt_ids=prompt,
                 output_ids=output, greedy=True) for i, (prompt, output) in enumerate(served)]  # fmt: skip
    captures.write_captures(rows)
    return endpoint


@pytest.mark.parametrize("multi_layer", [False, True])
def test_a_run_on_captured_traffic_trains_a_head_that_drafts(tmp_path, target_dir, endpoint, multi_layer, monkeypatch):
    from speculation.worker import candidates

    replayed: list[str] = []
    monkeypatch.setattr(candidates, "measure_candidates", lambda **job: replayed.append(job["request_id"]))
    # given a team admin's run on the endpoint's captured traffic, pooled
    admin = make_user("red-admin", ADMIN, teams=("red",))
    run = create_training_run(target_dir=str(target_dir), out_dir=str(tmp_path / "head"), name="from-traffic",
                              prompts=f"captured:{endpoint.name}", epochs=6, options={**OPTIONS, **TRAIN,
                              "multi_layer": multi_layer}, owner=admin)  # fmt: skip
    assert run.prompts == f"captured:{endpoint.pk}"
    # when it runs
    run = run_training(run=run)
    # then it trained on the captures (18 of them, the 3 oldest of each workload held out) and registered its head,
    assert run.status == TrainingStatus.DONE and run.epoch == 6
    train_part, held_part = split_prompts(captured_sequences(PipelineSettings.from_dict(run.config)), held_out=0.25)
    assert (len(train_part), len(held_part)) == (18, 6)
    assert run.draft.kind == DraftKind.EAGLE_HEAD
    assert run.draft.config["eagle"]["train_tokens"] == sum(len(s.prompt_ids) + 12 for s in train_part)
    assert set(run.log[-1]["categories"]) == {"chat", "code"}
    # whose drafts the target accepts on the held-out captures
    assert run.alpha > 0 and run.mean_accepted_len > 1.0
    # and which belongs to the endpoint's team: one of its auto-pairing candidates, no other team's
    assert run.draft.team.name == "red" and drafts_usable_by(endpoint).filter(pk=run.draft.pk).exists()
    # and it was replayed with the other candidates on the captures it held out
    assert replayed == [f"capture-{s.capture_id}" for s in held_part]
    # and no decrypted token ids were written beside it
    work = Path(run.out_dir) / "_work"
    assert not (work / "train.pt").exists() and not (work / "held_out.pt").exists()


def test_a_run_on_one_workload_reads_only_its_captures(target_dir, tmp_path, endpoint):
    run = create_training_run(target_dir=str(target_dir), out_dir=str(tmp_path / "h"),
                              prompts=f"captured:{endpoint.pk}:code", options=OPTIONS)  # fmt: skip
    sequences = captured_sequences(PipelineSettings.from_dict(run.config))
    assert len(sequences) == 12 and {s.category for s in sequences} == {"code"}
    assert all(s.prompt_ids and len(s.output_ids) == 12 for s in sequences)


def test_a_run_on_text_prompts_reads_no_captures():
    assert captured_sequences(PipelineSettings(prompts="spec_bench")) is None


def test_a_run_on_captured_traffic_belongs_to_the_endpoints_team(target_dir, tmp_path, endpoint):
    admin = make_user("red-admin", ADMIN, teams=("red", "blue"))
    run = create_training_run(target_dir=str(target_dir), out_dir=str(tmp_path / "h"),
                              prompts=f"captured:{endpoint.name}", owner=admin)  # fmt: skip
    assert run.team.name == "red"
    with pytest.raises(ValidationError) as caught:
        create_training_run(target_dir=str(target_dir), out_dir=str(tmp_path / "h2"),
                            prompts=f"captured:{endpoint.name}", owner=admin,
                            team=Group.objects.get(name="blue"))  # fmt: skip
    assert "team" in caught.value.message_dict


@pytest.mark.parametrize(("who", "role", "teams"), [("blue-admin", ADMIN, ("blue",)), ("red-op", OPERATOR, ("red",))])
def test_only_the_teams_admins_may_train_on_its_captures(target_dir, tmp_path, endpoint, who, role, teams):
    user = make_user(who, role, teams=teams)
    with pytest.raises(ValidationError) as caught:
        create_training_run(target_dir=str(target_dir), out_dir=str(tmp_path / "h"),
                            prompts=f"captured:{endpoint.name}", owner=user)  # fmt: skip
    # the same words as for an endpoint that does not exist
    assert caught.value.message_dict["prompts"] == [
        f"captured:{endpoint.name}: no endpoint whose captured traffic you may use (its team's admins)"
    ]


@pytest.mark.parametrize(
    ("prompts", "says"),
    [
        ("captured:captured,spec_bench", "not mixed"),
        ("captured:captured:nothing-here", "0 captured requests"),
        ("captured:no-such-endpoint", "no endpoint whose captured traffic"),
    ],
)
def test_a_bad_captured_source_is_refused_naming_prompts(target_dir, tmp_path, endpoint, prompts, says):
    with pytest.raises(ValidationError) as caught:
        create_training_run(target_dir=str(target_dir), out_dir=str(tmp_path / "h"), prompts=prompts)
    assert says in " ".join(caught.value.message_dict["prompts"])


def test_the_command_line_queues_a_run_on_captured_traffic(target_dir, tmp_path, endpoint):
    import io

    from django.core.management import call_command

    from speculation.models import TrainingRun

    # --queue records the run and queues it once the row commits: this test's transaction never does
    args = ["--target", str(target_dir), "--out", str(tmp_path / "h"), "--prompts", f"captured:{endpoint.name}:chat"]
    call_command("train_eagle", *args, "--multi-layer", "--queue", stdout=io.StringIO())
    run = TrainingRun.objects.get()
    assert (run.prompts, run.team.name, run.config["multi_layer"]) == (f"captured:{endpoint.pk}:chat", "red", True)
