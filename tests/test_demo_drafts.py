"""The run command's demo drafts belong to its admin, like the demo endpoint: other tenants do not see them."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from ace.demo_drafts import DEMO_DRAFT, register_demo_drafts
from fleet.permissions import OPERATOR, grant_role
from speculation.models import DraftKind, DraftModel
from speculation.selectors.drafts import visible_drafts
from speculation.services import drafts as draft_service

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def folders_are_not_read(monkeypatch):
    # What a folder holds is checked elsewhere (tests/speculation/services); here only who owns the drafts.
    monkeypatch.setattr(draft_service, "inspect_draft_dir", lambda path, kind: {"path": path, "vocab_size": 300})


def test_the_demo_drafts_are_the_admins_and_an_earlier_runs_unowned_one_becomes_so(tmp_path):
    # given the admin, an operator, and the demo draft as an earlier run registered it (no owner)
    admin = get_user_model().objects.create_superuser("admin", email="", password="pw-admin-123456")
    operator = get_user_model().objects.create_user("ops", password="pw-for-tests-only")
    grant_role(user=operator, role=OPERATOR)
    DraftModel.objects.create(name=DEMO_DRAFT, kind=DraftKind.DRAFT_MODEL, path=str(tmp_path / "a"), vocab_size=300)

    # when the run command registers the demo drafts
    drafts = register_demo_drafts(
        drafts={"draft": str(tmp_path / "a"), "draft-b": str(tmp_path / "b")},
        eagle_dir=str(tmp_path / "no-head"),
        target_name="ace-demo-target",
        owner=admin,
    )

    # then every one is the admin's, and an operator of no team sees none
    assert {(d.name, d.owner) for d in DraftModel.objects.all()} == {(DEMO_DRAFT, admin), ("demo-draft-b", admin)}
    assert len(drafts) == 2
    assert not visible_drafts(operator).exists()
