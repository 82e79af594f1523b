"""Managed endpoints: registration through REST and the form, validated field by field (400 naming the field)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from fleet.managed.args import ServerArgsError, build_argv, validate_server_args
from fleet.managed.models import ManagedServer
from fleet.managed.services import speculation_of
from fleet.models import Endpoint
from fleet.permissions import OPERATOR, VIEWER, grant_role

pytestmark = pytest.mark.django_db

URL = "/api/v1/managed-endpoints/"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "target"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return directory


@pytest.fixture
def user():
    user = get_user_model().objects.create_user(username="ops", password="pw-ops-123456")
    grant_role(user=user, role=OPERATOR)
    return user


@pytest.fixture
def api(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def _body(directory: Path, **overrides) -> dict:
    body = {
        "name": "managed-llama",
        "model_dir": str(directory),
        "served_name": "llama",
        "node_class": "cpu",
        "server_args": {"dtype": "float32", "max_model_len": 1024},
    }
    body.update(overrides)
    return body


def test_it_registers_a_managed_endpoint_owned_by_its_creator(api, user, model_dir):
    response = api.post(URL, _body(model_dir), format="json")

    assert response.status_code == 201, response.content
    endpoint = Endpoint.objects.get(name="managed-llama")
    assert endpoint.owner == user
    managed = ManagedServer.objects.get(endpoint=endpoint)
    assert managed.model_dir == str(model_dir.resolve())
    assert managed.server_args == {"dtype": "float32", "max_model_len": 1024}
    assert response.json()["managed"]["served_name"] == "llama"
    state = api.get(f"/api/v1/endpoints/{endpoint.pk}/managed/")
    assert state.status_code == 200 and state.json()["server_kind"] == "vllm"


@pytest.mark.parametrize(
    ("server_args", "named"),
    [
        ({"trust_remote_code": True}, "trust_remote_code"),
        ({"port": 9999}, "port"),
        ({"speculative_config": "{}"}, "speculative_config"),
        ({"max_model_len": "big"}, "max_model_len"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"dtype": "int4"}, "dtype"),
    ],
)
def test_it_refuses_unknown_unsafe_or_bad_arguments_naming_them(api, model_dir, server_args, named):
    response = api.post(URL, _body(model_dir, server_args=server_args), format="json")

    assert response.status_code == 400
    messages = response.json()["server_args"]
    assert any(message.startswith(named + ":") for message in messages), messages
    assert not Endpoint.objects.exists()


def test_it_refuses_a_model_dir_outside_the_roots_or_missing(api, model_dir, tmp_path):
    outside = api.post(URL, _body(model_dir, model_dir="/etc"), format="json")
    missing = api.post(URL, _body(model_dir, model_dir=str(tmp_path / "nope")), format="json")
    empty = tmp_path / "empty"
    empty.mkdir()
    not_a_model = api.post(URL, _body(model_dir, model_dir=str(empty)), format="json")

    assert outside.status_code == 400 and "model roots" in outside.json()["model_dir"][0]
    assert missing.status_code == 400 and "not a directory" in missing.json()["model_dir"][0]
    assert not_a_model.status_code == 400 and "config.json" in not_a_model.json()["model_dir"][0]
    assert not Endpoint.objects.exists()


def test_it_refuses_bad_names_kinds_and_unknown_fields(api, model_dir):
    bad_name = api.post(URL, _body(model_dir, name="Bad Name"), format="json")
    bad_kind = api.post(URL, _body(model_dir, kind="openai"), format="json")
    unknown = api.post(URL, _body(model_dir, base_url="http://127.0.0.1:1"), format="json")
    bad_served = api.post(URL, _body(model_dir, served_name="has space"), format="json")

    assert bad_name.status_code == 400 and "name" in bad_name.json()
    assert bad_kind.status_code == 400 and "kind" in bad_kind.json()
    assert unknown.status_code == 400 and "base_url" in unknown.json()
    assert bad_served.status_code == 400 and "served_name" in bad_served.json()


def test_a_viewer_may_not_register(model_dir):
    viewer = get_user_model().objects.create_user(username="viewer", password="pw-viewer-123456")
    grant_role(user=viewer, role=VIEWER)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=viewer).key}")

    assert client.post(URL, _body(model_dir), format="json").status_code == 403


def test_the_form_registers_and_shows_errors_on_fields(client, user, model_dir):
    client.force_login(user)
    bad = client.post(
        "/fleet/managed/new/",
        {
            "name": "m1",
            "kind": "vllm",
            "model_dir": "/etc",
            "node_class": "cpu",
            "dtype": "auto",
            "gpu_memory_utilization": "2",
        },
    )
    assert bad.status_code == 200
    assert b"model roots" in bad.content and b"gpu_memory_utilization" in bad.content

    good = client.post(
        "/fleet/managed/new/",
        {
            "name": "m1",
            "kind": "vllm",
            "model_dir": str(model_dir),
            "node_class": "cpu",
            "dtype": "float32",
            "max_model_len": "512",
        },
    )
    endpoint = Endpoint.objects.get(name="m1")
    assert good.status_code == 302
    page = client.get(f"/fleet/{endpoint.pk}/")
    assert b'id="managed-panel"' in page.content


def test_the_command_line_carries_the_arguments_and_the_native_flags():
    args = validate_server_args({"dtype": "float32", "max_model_len": 1024, "enforce_eager": True})
    argv = build_argv(
        kind="vllm",
        model_dir="/m",
        served_name="demo",
        host="127.0.0.1",
        port=8001,
        args=args,
        spec_args=["--speculative-config", "{}"],
    )

    assert argv[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    assert argv[argv.index("--max-model-len") + 1] == "1024" and "--enforce-eager" in argv
    assert argv[-2:] == ["--speculative-config", "{}"]
    with pytest.raises(ServerArgsError) as caught:
        validate_server_args({"chat_template": "/etc/passwd", "dtype": "float32"})
    assert set(caught.value.errors) == {"chat_template"}


def test_only_prod_asks_the_server_to_speculate():
    from speculation.models import SpeculationPolicy

    assert speculation_of(SpeculationPolicy(mode="shadow", mechanism="ngram", k=3)) == {}
    assert speculation_of(SpeculationPolicy(mode="prod", mechanism="ngram", k=3)) == {
        "draft_kind": "ngram",
        "draft_path": "",
        "k": 3,
    }


def test_vllms_cpu_build_runs_in_one_process_with_one_openmp_thread_unless_told_otherwise(monkeypatch):
    from ace import processes
    from fleet.managed.args import server_env

    monkeypatch.delenv("ACE_VLLM_OMP_THREADS", raising=False)
    monkeypatch.delenv("ACE_VLLM_MULTIPROCESSING", raising=False)
    monkeypatch.setattr(processes.glob, "glob", lambda pattern: [])  # no NVIDIA device
    env = server_env("vllm")
    # one process: nothing spins beside the model; one thread leaves a core to the gateway (ace.processes)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and env["OMP_NUM_THREADS"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    sglang = server_env("sglang")
    assert "OMP_NUM_THREADS" not in sglang and "VLLM_ENABLE_V1_MULTIPROCESSING" not in sglang
    monkeypatch.setattr(processes.glob, "glob", lambda pattern: ["/dev/nvidia0"])  # a GPU build keeps two
    assert server_env("vllm")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    monkeypatch.setenv("ACE_VLLM_MULTIPROCESSING", "0")
    assert server_env("vllm")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setenv("ACE_VLLM_MULTIPROCESSING", "bogus")  # warned, then auto
    assert server_env("vllm")["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
    monkeypatch.setenv("ACE_VLLM_OMP_THREADS", "2")
    assert server_env("vllm")["OMP_NUM_THREADS"] == "2"
    monkeypatch.setenv("ACE_VLLM_OMP_THREADS", "0")  # vLLM's own default
    assert "OMP_NUM_THREADS" not in server_env("vllm")


def test_a_served_name_clashes_only_with_the_owners_and_teams_endpoints_and_names_none_of_another_tenants(
    api, user, model_dir
):
    # given another tenant's endpoint serving "llama"
    bob = get_user_model().objects.create_user(username="bob", password="pw-bob-123456")
    Endpoint.objects.create(name="bobs-llama", base_url="http://127.0.0.1:9", served_model="llama", owner=bob)

    # when the operator registers a managed endpoint serving "llama", then a second one
    first = api.post(URL, _body(model_dir), format="json")
    second = api.post(URL, _body(model_dir, name="managed-llama-2"), format="json")

    # then the first is accepted (routing is per tenant), the second refused naming the operator's own endpoint
    assert first.status_code == 201, first.content
    assert second.status_code == 400
    assert "'managed-llama'" in second.json()["served_name"][0]
    assert "bobs-llama" not in second.content.decode()
