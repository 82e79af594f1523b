"""A finished run on captured traffic is repeated once enough new requests were captured, with its settings, owner
and team, and only while its owner is still an admin of the endpoint's team."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.contrib.auth.models import Group
from django.utils import timezone

from fleet.models import Endpoint
from fleet.permissions import ADMIN, OPERATOR, grant_role
from speculation.models import CapturedRequest, CaptureSetting, TrainingRun, TrainingStatus
from speculation.offline.eagle.settings import PipelineSettings
from speculation.services import captures
from speculation.services.capture_retraining import due, retrain, retrain_due
from speculation.services.eagle_training import create_training_run
from tests.support.users import make_user

pytestmark = pytest.mark.django_db


@pytest.fixture
def finished(demo_pair, tmp_path):
    """A done multi-layer run of a red admin on 10 captures of the red team's endpoint, finished an hour ago."""
    endpoint = Endpoint.objects.create(
        name="drifting", base_url="http://127.0.0.1:9", kind="vllm", team=Group.objects.get_or_create(name="red")[0]
    )
    CaptureSetting.objects.create(endpoint=endpoint, enabled=True)
    _capture(endpoint, 10)
    CapturedRequest.objects.update(created_at=timezone.now() - timedelta(hours=2))
    admin = make_user("red-admin", ADMIN, teams=("red",))
    run = create_training_run(target_dir=str(demo_pair.target_dir), out_dir=str(tmp_path / "head"), name="drift",
                              prompts=f"captured:{endpoint.pk}", epochs=3, owner=admin,
                              options={"multi_layer": True, "new_tokens": 16})  # fmt: skip
    TrainingRun.objects.filter(pk=run.pk).update(
        status=TrainingStatus.DONE, finished_at=timezone.now() - timedelta(hours=1)
    )
    run.refresh_from_db()
    return endpoint, run


def _capture(endpoint, n: int) -> None:
    rows = [dict(endpoint_id=endpoint.pk, workload="code", mode="off", prompt_ids=[5, 6], output_ids=[7])] * n
    captures.write_captures(rows)


def test_a_run_is_due_once_enough_new_requests_were_captured(finished):
    endpoint, run = finished
    _capture(endpoint, 3)
    assert due(min_new=3) == [run] and due(min_new=4) == []


def test_the_repeat_keeps_the_runs_settings_owner_and_team(finished):
    _, run = finished
    new = retrain(run, now=timezone.now())
    assert (new.prompts, new.owner, new.team, new.epochs, new.status) == (
        run.prompts, run.owner, run.team, 3, TrainingStatus.QUEUED,
    )  # fmt: skip
    old, fresh = PipelineSettings.from_dict(run.config), PipelineSettings.from_dict(new.config)
    assert fresh == old and fresh.multi_layer and fresh.new_tokens == 16
    assert new.out_dir.startswith(run.out_dir + "-") and new.out_dir != run.out_dir
    # and while it is queued, the sources are not due again
    _capture(finished[0], 300)
    assert due(min_new=3) == []


def test_a_run_whose_owner_is_no_longer_the_teams_admin_is_not_repeated(finished):
    endpoint, run = finished
    grant_role(user=run.owner, role=OPERATOR)
    _capture(endpoint, 300)
    assert retrain_due() == []
    assert TrainingRun.objects.count() == 1
