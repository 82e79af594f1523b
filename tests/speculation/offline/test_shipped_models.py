"""The demo models shipped in the repository: checked file by file, installed atomically, never built on a clone."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from speculation.offline.demo import build as demo_build
from speculation.offline.demo import ensure_demo_pair, shipped


def _fake_built(models_dir, version: str, *, head: bool = True) -> None:
    """A built pair (and head) in float32: one weights file, a config and a tokenizer file per directory."""
    generator = torch.Generator().manual_seed(0)
    dirs = ["target", "draft"]
    for label in dirs:
        directory = models_dir / version / label
        directory.mkdir(parents=True)
        save_file({"w": torch.randn(4, 4, generator=generator)}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps({"dtype": "float32"}))
        (directory / "tokenizer.json").write_text("{}")
    (models_dir / version / "build_info.json").write_text("{}")
    if head:
        directory = models_dir / f"{version}-eagle"
        directory.mkdir()
        save_file({"fc.weight": torch.randn(4, 8, generator=generator)}, str(directory / "model.safetensors"))
        (directory / "config.json").write_text("{}")
        (directory / "_work").mkdir()  # training work files are not shipped
        (directory / "_work" / "state.pt").write_bytes(b"x")


def test_export_writes_float16_weights_and_a_checksum_per_file(tmp_path):
    # given: a built pair and head
    _fake_built(tmp_path / "built", "demo-vX")
    # when
    manifest = shipped.export("demo-vX", tmp_path / "built", tmp_path / "models")
    # then: every file but the work files, each with its sha256; weights in float16, equal within its rounding
    assert sorted(manifest["files"]) == [
        "demo-vX-eagle/config.json", "demo-vX-eagle/model.safetensors",
        "demo-vX/build_info.json", "demo-vX/draft/config.json", "demo-vX/draft/model.safetensors",
        "demo-vX/draft/tokenizer.json", "demo-vX/target/config.json", "demo-vX/target/model.safetensors",
        "demo-vX/target/tokenizer.json",
    ]  # fmt: skip
    for name, digest in manifest["files"].items():
        assert shipped.sha256_of(tmp_path / "models" / name) == digest
    original = load_file(tmp_path / "built" / "demo-vX" / "target" / "model.safetensors")["w"]
    exported = load_file(tmp_path / "models" / "demo-vX" / "target" / "model.safetensors")["w"]
    assert exported.dtype == torch.float16
    assert torch.allclose(exported.float(), original, rtol=1e-3, atol=1e-4)


def test_install_copies_what_is_missing_and_checks_every_file(tmp_path):
    _fake_built(tmp_path / "built", "demo-vX")
    shipped.export("demo-vX", tmp_path / "built", tmp_path / "models")
    models_dir = tmp_path / "home"
    models_dir.mkdir()
    installed = shipped.install_shipped("demo-vX", models_dir, tmp_path / "models")
    assert installed == [models_dir / "demo-vX", models_dir / "demo-vX-eagle"]
    for name in shipped.read_manifest(tmp_path / "models")["files"]:
        assert (models_dir / name).read_bytes() == (tmp_path / "models" / name).read_bytes()
    assert shipped.install_shipped("demo-vX", models_dir, tmp_path / "models") == []  # already there


def test_a_file_that_does_not_match_its_checksum_is_refused_and_nothing_is_installed(tmp_path):
    _fake_built(tmp_path / "built", "demo-vX")
    shipped.export("demo-vX", tmp_path / "built", tmp_path / "models")
    (tmp_path / "models" / "demo-vX" / "draft" / "model.safetensors").write_bytes(b"tampered")
    models_dir = tmp_path / "home"
    models_dir.mkdir()
    with pytest.raises(shipped.ShippedModelError, match="demo-vX/draft/model.safetensors does not match"):
        shipped.install_shipped("demo-vX", models_dir, tmp_path / "models")
    assert list(models_dir.iterdir()) == []


def test_the_shipped_head_is_not_installed_beside_a_locally_built_pair(tmp_path):
    # given: a shipped pair and head, and a local build of the same version with other weights
    _fake_built(tmp_path / "built", "demo-vX")
    shipped.export("demo-vX", tmp_path / "built", tmp_path / "models")
    _fake_built(tmp_path / "home", "demo-vX", head=False)
    # when / then: the head, trained for the shipped target, stays out
    assert shipped.install_shipped("demo-vX", tmp_path / "home", tmp_path / "models") == []
    assert not (tmp_path / "home" / "demo-vX-eagle").exists()


def test_ensure_demo_pair_installs_the_shipped_pair_without_building(tmp_path, monkeypatch):
    _fake_built(tmp_path / "built", demo_build.DEMO_VERSION)
    shipped.export(demo_build.DEMO_VERSION, tmp_path / "built", tmp_path / "models")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "models")
    monkeypatch.setattr(demo_build, "build_demo_pair", lambda out, name=None: pytest.fail("must not build"))
    monkeypatch.setattr(demo_build, "_missing_drafts", lambda root, recipe: [])
    pair = ensure_demo_pair(models_dir=tmp_path / "home")
    assert pair.target_dir == tmp_path / "home" / demo_build.DEMO_VERSION / "target"
    assert (pair.target_dir / "model.safetensors").is_file()
    assert (tmp_path / "home" / f"{demo_build.DEMO_VERSION}-eagle" / "config.json").is_file()


def test_a_broken_shipped_file_falls_back_to_building(tmp_path, monkeypatch):
    _fake_built(tmp_path / "built", demo_build.DEMO_VERSION)
    shipped.export(demo_build.DEMO_VERSION, tmp_path / "built", tmp_path / "models")
    (tmp_path / "models" / demo_build.DEMO_VERSION / "target" / "config.json").write_text("{}\n")
    monkeypatch.setattr(shipped, "SHIPPED_DIR", tmp_path / "models")
    built = []

    def build(out, name=None):
        built.append(name)
        for label in ("target", "draft"):
            (out / label).mkdir()

    monkeypatch.setattr(demo_build, "build_demo_pair", build)
    monkeypatch.setattr(demo_build, "_missing_drafts", lambda root, recipe: [])
    ensure_demo_pair(models_dir=tmp_path / "home")
    assert built == [demo_build.DEMO_VERSION]


def test_the_repository_ships_the_demo_version_with_its_strongest_head():
    """Every shipped file matches the manifest; the head is the multi-layer one, trained for the shipped target."""
    from speculation.engine.eagle import check_target, read_head_config

    files = shipped.read_manifest()["files"]
    version = demo_build.DEMO_VERSION
    assert shipped.shipped_dirs(version) == [version, version + shipped.HEAD_SUFFIX]
    for name, digest in files.items():
        assert shipped.sha256_of(shipped.SHIPPED_DIR / name) == digest, name
    head_dir = shipped.SHIPPED_DIR / (version + shipped.HEAD_SUFFIX)
    config = read_head_config(head_dir)
    check_target(config, shipped.SHIPPED_DIR / version / "target")
    trained = json.loads((head_dir / "config.json").read_text())["ace_eagle"]["trained"]
    assert trained["alpha"] >= 0.75  # the documented head's held-out alpha is 0.81 (docs/BENCHMARKS.md)
