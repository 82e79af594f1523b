"""The run command's demo endpoint is a managed endpoint: the launcher registers it (or turns the one an earlier
run registered by URL into one) and the worker's supervisor runs its vLLM. What `bash scripts/run.sh` then
serves end to end was checked by hand (docs/OPERATIONS.md)."""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model

from ace.launcher import (
    DEMO_DRAFT,
    DEMO_ENDPOINT,
    DEMO_MODEL_NAME,
    DEMO_SERVER_ARGS,
    demo_serving,
    register_demo_endpoint,
)
from fleet.managed.models import ManagedServer
from fleet.managed.services import NOT_STARTED_URL
from fleet.models import Endpoint
from speculation.models import DraftModel
from speculation.services.policies import get_policy

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin():
    return get_user_model().objects.create_superuser("admin", email="", password="pw-admin-123456")


def _register(demo_pair) -> Endpoint:
    return register_demo_endpoint(target_dir=str(demo_pair.target_dir), draft_dir=str(demo_pair.draft_dir))


def test_the_demo_endpoint_is_managed_by_the_cpu_worker(demo_pair, admin):
    endpoint = _register(demo_pair)

    managed = ManagedServer.objects.get(endpoint=endpoint)
    assert (endpoint.name, endpoint.node_class, endpoint.owner) == (DEMO_ENDPOINT, "cpu", admin)
    assert endpoint.base_url == NOT_STARTED_URL  # until the supervisor's instance serves
    assert managed.model_dir == str(demo_pair.target_dir.resolve()) and managed.served_name == DEMO_MODEL_NAME
    assert managed.server_args == DEMO_SERVER_ARGS and managed.serving_speculation == {}
    assert DraftModel.objects.get(name=DEMO_DRAFT).path == str(demo_pair.draft_dir.resolve())
    policy = get_policy(endpoint=endpoint)
    assert policy.target_path == str(demo_pair.target_dir.resolve())
    assert policy.path == "local"  # prod on the demo: ACE's own speculation against the plain instance
    assert demo_serving() == ""


def test_a_second_run_registers_nothing_twice_and_forgets_the_last_runs_port(demo_pair, admin):
    first = _register(demo_pair)
    Endpoint.objects.filter(pk=first.pk).update(base_url="http://127.0.0.1:45678", status="ready")
    assert "http://127.0.0.1:45678" in demo_serving()

    again = _register(demo_pair)

    assert again.pk == first.pk and Endpoint.objects.count() == 1 and ManagedServer.objects.count() == 1
    again.refresh_from_db()
    assert (again.base_url, again.status) == (NOT_STARTED_URL, "new") and demo_serving() == ""


# prod on ACE's local path runs against the plain managed instance and stays; prod on path auto would be the
# server's own speculation, a switch of a server that is not started yet: the converted endpoint starts in off
@pytest.mark.parametrize(("path", "mode_after"), [("local", "prod"), ("auto", "off")])
def test_a_demo_endpoint_registered_by_url_becomes_managed(demo_pair, admin, path, mode_after):
    old = Endpoint.objects.create(
        name=DEMO_ENDPOINT, base_url="http://127.0.0.1:9", kind="vllm", node_class="cpu", status="ready"
    )
    policy = get_policy(endpoint=old)
    policy.mode, policy.path = "prod", path
    policy.save()

    endpoint = _register(demo_pair)

    assert endpoint.pk == old.pk
    endpoint.refresh_from_db()
    assert endpoint.base_url == NOT_STARTED_URL and endpoint.owner == admin
    assert ManagedServer.objects.get(endpoint=endpoint).served_name == DEMO_MODEL_NAME
    assert get_policy(endpoint=endpoint).mode == mode_after


@pytest.fixture
def demo_candidates(demo_pair, tmp_path):
    """A second demo draft (the demo draft's files under another label) and an (untrained) EAGLE head saved for
    the demo target, as a demo version with two drafts and a built head has them."""
    import shutil

    import torch

    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights

    code_dir = shutil.copytree(demo_pair.draft_dir, tmp_path / "draft-code")
    head = EagleHead(EagleConfig.for_target(demo_pair.target_dir))
    init_weights(head, torch.Generator().manual_seed(0))
    head.save(tmp_path / "demo-eagle")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):  # as training saves it
        if (demo_pair.target_dir / name).is_file():
            shutil.copy(demo_pair.target_dir / name, tmp_path / "demo-eagle" / name)
    return {"extra_drafts": {"draft-code": str(code_dir)}, "eagle_dir": str(tmp_path / "demo-eagle")}


def test_the_demo_gets_every_candidate_and_a_new_demo_drafts_with_auto(demo_pair, admin, demo_candidates):
    from ace.demo_drafts import DEMO_EAGLE

    endpoint = register_demo_endpoint(
        target_dir=str(demo_pair.target_dir), draft_dir=str(demo_pair.draft_dir), **demo_candidates
    )

    drafts = {d.name: d for d in DraftModel.objects.all()}
    assert set(drafts) == {DEMO_DRAFT, "demo-draft-code", DEMO_EAGLE}
    assert drafts["demo-draft-code"].path == demo_candidates["extra_drafts"]["draft-code"]
    assert (drafts[DEMO_EAGLE].kind, drafts[DEMO_EAGLE].target_name) == ("eagle_head", DEMO_MODEL_NAME)
    # the same tokenizer: shadow replays both drafts as candidates of the demo endpoint
    assert drafts[DEMO_DRAFT].tokenizer_fingerprint == drafts["demo-draft-code"].tokenizer_fingerprint
    # a new demo drafts with the EAGLE head's chain at dynamic K (the demo's fastest pairing on a CPU)
    policy = get_policy(endpoint=endpoint)
    assert (policy.mechanism, policy.draft.name, policy.dynamic_k, policy.auto_pairing, policy.path) == (
        "eagle_head",
        DEMO_EAGLE,
        True,
        True,
        "local",
    )


def test_a_new_demo_without_a_head_drafts_with_the_demo_draft(demo_pair, admin, tmp_path):
    endpoint = register_demo_endpoint(
        target_dir=str(demo_pair.target_dir), draft_dir=str(demo_pair.draft_dir), eagle_dir=str(tmp_path / "none")
    )

    policy = get_policy(endpoint=endpoint)
    assert (policy.mechanism, policy.draft.name, policy.auto_pairing) == ("draft_model", DEMO_DRAFT, True)


def test_a_head_not_built_yet_is_trained_in_the_background_and_registered_later(demo_pair, admin, tmp_path):
    from ace.demo_drafts import DEMO_EAGLE, eagle_ready, eagle_training_argv

    missing = str(tmp_path / "no-head-yet")
    register_demo_endpoint(target_dir=str(demo_pair.target_dir), draft_dir=str(demo_pair.draft_dir), eagle_dir=missing)

    assert not eagle_ready(missing) and not DraftModel.objects.filter(name=DEMO_EAGLE).exists()
    argv = eagle_training_argv(target_dir=str(demo_pair.target_dir), eagle_dir=missing, target_name=DEMO_MODEL_NAME)
    assert argv[argv.index("manage.py") + 1] == "train_eagle"
    assert argv[argv.index("--out") + 1] == missing and argv[argv.index("--name") + 1] == DEMO_EAGLE


def test_a_demo_draft_of_an_earlier_demo_version_follows_the_current_one(demo_pair, admin, demo_candidates):
    _register(demo_pair)
    other = demo_candidates["extra_drafts"]["draft-code"]  # stands in for a rebuilt version's draft

    register_demo_endpoint(target_dir=str(demo_pair.target_dir), draft_dir=other)

    draft = DraftModel.objects.get(name=DEMO_DRAFT)
    assert draft.path == other and DraftModel.objects.filter(name=DEMO_DRAFT).count() == 1
    policy = get_policy(endpoint=Endpoint.objects.get(name=DEMO_ENDPOINT))
    assert policy.draft_id == draft.pk  # the policy keeps drafting with it
