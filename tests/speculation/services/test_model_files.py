"""Files only where they belong, and every malformed model folder a 400 naming the file and the problem.

Pinned cases: six malformed draft folders (REST and the dashboard form), a policy target_path of /etc in off
mode, a training run's output directory, messages that must not tell apart "exists" and "does not exist", and a
planted checkpoint that must not be unpickled with weights_only=False.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from fleet.models import Endpoint, EndpointStatus
from tests.support.models import served_reference_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def root(settings, tmp_path) -> Path:
    """The only model root of these tests (not the session's tmp dirs)."""
    models = tmp_path / "models"
    models.mkdir()
    settings.MODEL_ROOTS = [models.resolve()]
    return models.resolve()


@pytest.fixture
def admin_api(django_user_model):
    from rest_framework.test import APIClient

    client = APIClient()
    client.force_authenticate(django_user_model.objects.create_superuser("root", password="pw-for-tests-only"))
    return client


@pytest.fixture
def admin_browser(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root-ui", password="pw-for-tests-only"))
    return client


def _copy(tiny_model_dir: Path, root: Path, name: str) -> Path:
    target = root / name
    shutil.copytree(tiny_model_dir, target)
    return target


def _weights(directory: Path) -> Path:
    return next(directory.glob("*.safetensors"))


def truncate(d: Path) -> None:
    file = _weights(d)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def huge_header_length(d: Path) -> None:
    file = _weights(d)
    file.write_bytes(struct.pack("<Q", 2**64 - 1) + file.read_bytes()[8:])


def non_json_header(d: Path) -> None:
    _weights(d).write_bytes(struct.pack("<Q", 10) + b"not json!!" + b"\0" * 16)


def missing_shape(d: Path) -> None:
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "data_offsets": [0, 4]}}).encode()
    _weights(d).write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)


def config_is_a_list(d: Path) -> None:
    (d / "config.json").write_text("[1, 2, 3]")


def string_vocab_size(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "vocab_size": "300"}))


def mixture_of_experts(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_moe", "num_experts": 8}))


def quantized(d: Path) -> None:
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))


def shorter_than_8_bytes(d: Path) -> None:
    _weights(d).write_bytes(b"\x01\x02")


MALFORMED = [
    (truncate, "model.safetensors", "outside the file (truncated?)"),
    (huge_header_length, "model.safetensors", "exceeds safetensors' 100 MB limit"),
    (non_json_header, "model.safetensors", "the header is not JSON"),
    (missing_shape, "model.safetensors", "missing or invalid shape"),
    (config_is_a_list, "config.json", "must be a JSON object, not a list"),
    (string_vocab_size, "config.json", "vocab_size must be a positive integer, not '300'"),
    (shorter_than_8_bytes, "model.safetensors", "truncated: shorter than the 8-byte header length"),
    (mixture_of_experts, "config.json", "mixture-of-experts models are not supported"),
    (quantized, "config.json", "quantized checkpoints are not supported (quantization_config: gptq)"),
]


@pytest.mark.parametrize(("breaks", "file", "problem"), MALFORMED, ids=[m[0].__name__ for m in MALFORMED])
def test_a_malformed_draft_folder_is_a_400_naming_the_file_on_rest_and_the_form(
    admin_api, admin_browser, tiny_model_dir, root, breaks, file, problem
):
    # given a model folder under the roots with one broken file
    folder = _copy(tiny_model_dir, root, breaks.__name__)
    breaks(folder)
    # when it is registered through REST and through the dashboard form
    response = admin_api.post("/api/v1/drafts/", {"name": "d1", "kind": "draft_model", "path": str(folder)},
                              format="json")  # fmt: skip
    page = admin_browser.post("/dashboard/drafts/", {"name": "d2", "kind": "draft_model", "path": str(folder),
                                                     "node_class": "cpu"})  # fmt: skip
    # then both refuse it with the file and the problem, and nothing is saved
    assert response.status_code == 400, response.content
    message = response.json()["path"][0]
    assert file in message and problem in message
    assert page.status_code in (200, 400)
    assert problem.replace("'", "&#x27;") in page.content.decode()
    from speculation.models import DraftModel

    assert not DraftModel.objects.exists()


def test_a_good_folder_under_the_roots_registers(admin_api, tiny_model_dir, root):
    folder = _copy(tiny_model_dir, root, "good")
    response = admin_api.post("/api/v1/drafts/", {"name": "good", "kind": "draft_model", "path": str(folder)},
                              format="json")  # fmt: skip
    assert response.status_code == 201, response.json()
    assert response.json()["path"] == str(folder)


@pytest.mark.parametrize("family", ["qwen3", "gemma2", "phi3"])
def test_a_folder_of_another_family_the_engine_runs_registers(admin_api, tiny_model_dir, root, family):
    # given a folder whose config.json is of a non-Llama family (its own keys: an explicit head_dim)
    folder = _copy(tiny_model_dir, root, family)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": family, "head_dim": 48}))
    # when it is registered, then it is accepted
    response = admin_api.post("/api/v1/drafts/", {"name": family, "kind": "draft_model", "path": str(folder)},
                              format="json")  # fmt: skip
    assert response.status_code == 201, response.json()


def test_paths_outside_the_roots_get_one_message_whether_or_not_they_exist(admin_api, root, tmp_path, tiny_model_dir):
    # given an existing model folder, an existing system directory and a missing path, all outside the root,
    # and a symlink inside the root that points outside
    outside_model = tiny_model_dir
    link = root / "link"
    link.symlink_to(outside_model)
    messages = []
    for path in (str(outside_model), "/etc", "/no/such/dir", str(link), "../../etc"):
        response = admin_api.post("/api/v1/drafts/", {"name": "x", "kind": "draft_model", "path": path}, format="json")
        assert response.status_code == 400, (path, response.content)
        messages.append(response.json()["path"][0])
    # then every answer is the same sentence: nothing tells what exists
    assert len(set(messages)) == 1, messages
    assert "must lie under the model roots" in messages[0] and str(root) in messages[0]


def _endpoint(**capabilities) -> Endpoint:
    return Endpoint.objects.create(
        name="ep", base_url="http://127.0.0.1:9", status=EndpointStatus.READY, capabilities=capabilities
    )


def test_a_policy_target_path_outside_the_roots_is_refused_even_in_off_mode(admin_api, root):
    endpoint = _endpoint()
    # /etc was saved before (off and shadow did not look at it)
    response = admin_api.patch(f"/api/v1/endpoints/{endpoint.pk}/policy/", {"target_path": "/etc"}, format="json")
    assert response.status_code == 400, response.content
    assert "must lie under the model roots" in response.json()["target_path"][0]


def test_a_policy_target_path_must_be_a_loadable_model_with_the_endpoints_tokenizer(
    admin_api, admin_browser, tiny_model_dir, root
):
    from speculation.services.model_files import tokenizer_fingerprint

    good = _copy(tiny_model_dir, root, "target")
    endpoint = _endpoint(tokenizer_fingerprint="0" * 64)
    url = f"/api/v1/endpoints/{endpoint.pk}/policy/"
    # a folder with only a config.json (accepted for prod before)
    bare = root / "bare"
    bare.mkdir()
    (bare / "config.json").write_text("{}")
    response = admin_api.patch(url, {"target_path": str(bare)}, format="json")
    assert response.status_code == 400
    assert "config.json: model_type None is not supported" in response.json()["target_path"][0]
    # a model whose tokenizer is not the endpoint's
    response = admin_api.patch(url, {"target_path": str(good)}, format="json")
    assert response.status_code == 400
    assert "does not match the endpoint's" in response.json()["target_path"][0]
    # a broken safetensors header through the dashboard form
    broken = _copy(tiny_model_dir, root, "broken")
    missing_shape(broken)
    form = {"mode": "off", "mechanism": "ngram", "k": 5, "shadow_sample_rate": 0.1, "path": "auto",
            "target_path": str(broken)}  # fmt: skip
    page = admin_browser.post(f"/dashboard/endpoints/{endpoint.pk}/policy/", form)
    assert page.status_code == 400
    assert "missing or invalid shape" in page.content.decode()
    # the endpoint's own model is accepted in off mode (the probe recorded its answers on the canary)
    Endpoint.objects.filter(pk=endpoint.pk).update(
        capabilities={
            "tokenizer_fingerprint": tokenizer_fingerprint(good, field="target_path"),
            "canary_reference": served_reference_of(good),
        }
    )
    response = admin_api.patch(url, {"target_path": str(good)}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["target_path"] == str(good)


def test_a_training_run_may_write_only_under_the_roots(admin_api, tiny_model_dir, root):
    target = _copy(tiny_model_dir, root, "target")
    for out_dir in ("/etc/ace-planted", "/tmp/elsewhere", str(root / ".." / "escape")):
        response = admin_api.post("/api/v1/training-runs/", {"target_dir": str(target), "out_dir": out_dir},
                                  format="json")  # fmt: skip
        assert response.status_code == 400, (out_dir, response.content)
        assert "out_dir must lie under the model roots" in response.json()["out_dir"][0]
    response = admin_api.post("/api/v1/training-runs/", {"target_dir": "/etc", "out_dir": str(root / "head")},
                              format="json")  # fmt: skip
    assert response.status_code == 400
    assert "target_dir must lie under the model roots" in response.json()["target_dir"][0]
    assert not (root / "head").exists()


class _Planted:
    marker: Path

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_checkpoint_is_never_unpickled(tmp_path):
    import torch

    from speculation.engine.eagle import EagleConfig, EagleHead
    from speculation.offline.eagle.collect import Sequences
    from speculation.offline.eagle.train import CHECKPOINT, TrainSettings, train_head

    # given a checkpoint whose unpickling would run code (here: create a marker file)
    marker = tmp_path / "code-ran"
    planted = _Planted()
    planted.marker = marker
    work = tmp_path / "_work"
    work.mkdir()
    torch.save({"epoch": 1, "settings": planted}, work / CHECKPOINT)
    torch.load(work / CHECKPOINT, weights_only=False)  # the attack works with the old call...
    assert marker.exists()
    marker.unlink()
    # when training resumes from it
    config = EagleConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                         vocab_size=50, max_position_embeddings=64)  # fmt: skip
    data = Sequences(tokens=[torch.zeros(8, dtype=torch.long)], features=[torch.zeros(8, 16)], prompt_lens=[4],
                     categories=["x"])  # fmt: skip
    with pytest.raises(ValueError, match="not a checkpoint ACE wrote"):
        train_head(EagleHead(config), torch.randn(50, 16), torch.randn(50, 16), data, data,
                   TrainSettings(epochs=1), work_dir=work)  # fmt: skip
    # then nothing ran
    assert not marker.exists()
