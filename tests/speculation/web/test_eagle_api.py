"""Training runs over REST, and the EAGLE / native-path includes on the dashboard pages."""

from __future__ import annotations

import pytest
from django.urls import reverse

from fleet.models import Endpoint
from speculation.models import DraftModel, SpeculationPolicy, TrainingRun, TrainingStatus

pytestmark = pytest.mark.django_db


@pytest.fixture
def run(tmp_path):
    return TrainingRun.objects.create(
        name="head-a", target_dir=str(tmp_path), target_name="demo", out_dir=str(tmp_path / "out"), epochs=4,
        status=TrainingStatus.RUNNING, stage="train", epoch=2, loss=0.5, alpha=0.71, mean_accepted_len=2.9,
        log=[{"epoch": 1, "loss": 0.9}, {"epoch": 2, "loss": 0.5}],
    )  # fmt: skip


def test_a_run_exposes_its_progress_for_polling(api, run):
    body = api.get(f"/api/v1/training-runs/{run.pk}/").json()

    assert (body["status"], body["epoch"], body["progress"]) == ("running", 2, 0.5)
    assert body["alpha"] == 0.71 and len(body["log"]) == 2


def test_runs_are_listed_newest_first(api, run, tmp_path):
    newer = TrainingRun.objects.create(name="head-b", target_dir=str(tmp_path), out_dir=str(tmp_path / "b"))

    names = [r["name"] for r in api.get("/api/v1/training-runs/").json()["results"]]

    assert names == [newer.name, run.name]


def test_queueing_a_run_for_a_directory_without_a_model_is_a_400(api, tmp_path):
    response = api.post("/api/v1/training-runs/", {"target_dir": str(tmp_path), "out_dir": str(tmp_path / "o")})

    assert response.status_code == 400
    assert "not a model directory" in response.json()["target_dir"][0]


def test_queueing_a_run_records_it_queued_with_its_settings(api, tiny_model_dir, tmp_path):
    response = api.post(
        "/api/v1/training-runs/",
        {"target_dir": str(tiny_model_dir), "out_dir": str(tmp_path / "o"), "epochs": 2, "seed": 7},
        format="json",
    )

    assert response.status_code == 201, response.json()
    run = TrainingRun.objects.get(pk=response.json()["id"])
    assert (run.status, run.epochs, run.seed) == (TrainingStatus.QUEUED, 2, 7)
    assert run.config["train"]["seed"] == 7


@pytest.fixture
def client_in(client, user):
    client.force_login(user)
    return client


def test_the_endpoint_page_shows_the_launch_flags_of_its_draft(client_in):
    endpoint = Endpoint.objects.create(name="gpu-a", base_url="http://10.0.0.5:8000", kind="vllm")
    head = DraftModel.objects.create(name="head-1", kind="eagle_head", path="/heads/h1")
    SpeculationPolicy.objects.create(endpoint=endpoint, mechanism="eagle_head", draft=head, k=4)

    body = client_in.get(reverse("speculation:endpoint", args=[endpoint.pk]), {"view": "settings"}).content.decode()

    assert 'id="native-flags"' in body
    assert "--speculative-config" in body and "&quot;method&quot;:&quot;eagle&quot;" in body


def test_the_endpoint_page_says_why_an_openai_server_has_no_flags(client_in):
    endpoint = Endpoint.objects.create(name="oai", base_url="http://10.0.0.6:8000", kind="openai")

    body = client_in.get(reverse("speculation:endpoint", args=[endpoint.pk]), {"view": "settings"}).content.decode()

    assert 'id="native-flags-reason"' in body and "remote or local verification path" in body


def test_the_drafts_page_lists_training_runs_with_their_progress(client_in, run):
    body = client_in.get(reverse("speculation:draft-list")).content.decode()

    assert 'id="training-runs-table"' in body
    assert f'data-run="{run.pk}"' in body and "2/4" in body and "0.710" in body
