"""`manage.py calibrate`: Spec-Bench prompts through the endpoint, every candidate replayed, a per-category table;
bad arguments exit with status 2."""

from __future__ import annotations

import json

import pytest
from django.core.management import call_command, execute_from_command_line

from fleet.models import Endpoint, EndpointStatus
from speculation.engine.projection import StepCosts
from speculation.models import CandidateMeasurement, SpeculationPolicy
from speculation.services.drafts import register_draft
from speculation.worker import candidates

pytestmark = pytest.mark.django_db(transaction=True)

PROMPT_IDS = [5, 6, 7, 8, 5, 6, 7]
OUTPUT_IDS = [8, 5, 6, 7, 8, 9]


class FakeCalibration:
    def step_costs(self) -> StepCosts:
        return StepCosts(target_step_s=0.02, draft_step_s=0.002, verify_s={1: 0.02, 9: 0.03})


@pytest.fixture
def endpoint(http_stub, tiny_model_dir, monkeypatch):
    reply = {"choices": [{"index": 0, "text": "x", "prompt_token_ids": PROMPT_IDS, "token_ids": OUTPUT_IDS}]}
    upstream = http_stub({("POST", "/v1/completions"): lambda request: reply})
    draft = register_draft(name="tiny-draft", kind="draft_model", path=str(tiny_model_dir))
    endpoint = Endpoint.objects.create(
        name="cal", base_url=upstream.base_url, kind="vllm", served_model="m", status=EndpointStatus.READY,
        capabilities={"tokenizer_fingerprint": draft.tokenizer_fingerprint},
    )  # fmt: skip
    SpeculationPolicy.objects.create(endpoint=endpoint, mode="shadow")
    monkeypatch.setattr(candidates, "current_costs", lambda **kwargs: FakeCalibration())  # no server to time
    return endpoint


def test_it_prints_and_writes_the_per_category_table_and_seeds_auto_pairing(endpoint, tmp_path, capsys):
    out = tmp_path / "cal.json"

    call_command("calibrate", "cal", "--sample", "1", "--max-tokens", "6", "--json", str(out))

    result = json.loads(out.read_text())
    assert result["prompts"] == 13 and not result["errors"]
    assert len(result["categories"]) == 13
    for cells in result["categories"].values():
        assert set(cells) == {"ngram", "suffix", "tiny-draft", "suffix+tiny-draft"}
        assert cells["ngram"]["requests"] == 1 and cells["ngram"]["projected_multiplier"] is not None
    printed = capsys.readouterr().out
    assert "translation" in printed and "tiny-draft" in printed
    # stored like shadow's rows, keyed by the prompt's workload category
    workloads = set(CandidateMeasurement.objects.filter(endpoint=endpoint).values_list("workload", flat=True))
    assert {"code", "math", "translation", "summarization", "qa", "rag", "writing", "chat"} == workloads


@pytest.mark.parametrize(
    "argv",
    [["calibrate", "nope"], ["calibrate", "cal", "--sample", "0"], ["calibrate", "cal", "--sample", "x"], []],
    ids=["unknown-endpoint", "sample-0", "sample-not-a-number", "no-endpoint"],
)
def test_bad_arguments_exit_with_status_2(endpoint, argv, capsys):
    with pytest.raises(SystemExit) as exited:
        execute_from_command_line(["manage.py", *(argv or ["calibrate"])])
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip()  # a message says what is wrong
