"""The demo models shipped in the repository (``models/``), installed into ``$ACE_HOME/models`` instead of built.

A fresh clone serves the demo at once: ``install_shipped()`` copies every shipped directory of a demo version (the
pair ``<version>`` and its EAGLE head ``<version>-eagle``) that ``$ACE_HOME/models`` lacks, after checking each
file against ``models/MANIFEST.json``; a file that does not match is refused with the reason (the pair is then
built as before). The weights are float16 safetensors, read as float32 by every loader (the engine, vLLM with
``--dtype float32``, transformers), so the shipped files are the models: the EAGLE head was trained against the
shipped target and records its fingerprint.

The builder stays the way to reproduce them (``speculation.offline.demo.build``, ``...eagle.demo_head``)::

    python -m speculation.offline.demo.shipped export [--version V] [--out models]

writes a built pair and its head from ``$ACE_HOME/models`` into ``models/`` as float16 and rewrites the manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

SHIPPED_DIR = Path(__file__).resolve().parents[3] / "models"
MANIFEST = "MANIFEST.json"
HEAD_SUFFIX = "-eagle"
_CHUNK = 1 << 20


class ShippedModelError(Exception):
    """A shipped file is missing or does not match its recorded checksum."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(shipped: Path | None = None) -> dict:
    """``{"files": {relative path: sha256}, ...}``; empty when nothing is shipped."""
    path = (shipped or SHIPPED_DIR) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else {"files": {}}


def shipped_dirs(version: str, shipped: Path | None = None) -> list[str]:
    """The shipped top-level directories of ``version``: the pair and, when shipped, its EAGLE head."""
    tops = {name.split("/", 1)[0] for name in read_manifest(shipped)["files"]}
    return [name for name in (version, version + HEAD_SUFFIX) if name in tops]


def install_shipped(version: str, models_dir: Path, shipped: Path | None = None) -> list[Path]:
    """Copy the shipped directories of ``version`` that ``models_dir`` lacks into it, each checked file by file
    against the manifest into a temporary directory renamed into place (a reader never sees half a model).
    Returns the directories installed; raises ShippedModelError naming the first file that does not match."""
    shipped = shipped or SHIPPED_DIR
    files = read_manifest(shipped)["files"]
    installed = []
    for top in shipped_dirs(version, shipped):
        final = models_dir / top
        if final.exists():
            continue
        if top != version and not _is_shipped_pair(version, models_dir, files):
            logger.info("the %s in %s is a local build: its shipped EAGLE head does not fit it", version, models_dir)
            continue
        tmp = models_dir / f".{top}.install-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for name, digest in files.items():
                if name.split("/", 1)[0] != top:
                    continue
                source = shipped / name
                if not source.is_file():
                    raise ShippedModelError(f"shipped model file {name} is missing (models/{MANIFEST} lists it)")
                if sha256_of(source) != digest:
                    raise ShippedModelError(
                        f"shipped model file {name} does not match its checksum in models/{MANIFEST}"
                    )
                dest = tmp / name.split("/", 1)[1]
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, dest)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        installed.append(final)
        logger.info("installed the shipped %s into %s", top, final)
    return installed


def _is_shipped_pair(version: str, models_dir: Path, files: dict) -> bool:
    """Whether the installed pair's target is the shipped one (a head is trained for one target)."""
    name = f"{version}/target/model.safetensors"
    local = models_dir / name
    return name in files and local.is_file() and sha256_of(local) == files[name]


def export(version: str, models_dir: Path, out: Path = SHIPPED_DIR) -> dict:
    """Write ``models_dir/<version>`` and ``<version>-eagle`` (when built) into ``out`` as float16 safetensors
    with every other file as it is, replacing what ``out`` shipped for that version; returns the manifest."""
    import torch
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out)
    files = {k: v for k, v in manifest["files"].items() if k.split("/", 1)[0] not in (version, version + HEAD_SUFFIX)}
    for top in (version, version + HEAD_SUFFIX):
        source = models_dir / top
        if not source.is_dir():
            continue
        dest_top = out / top
        shutil.rmtree(dest_top, ignore_errors=True)
        for path in sorted(p for p in source.rglob("*") if p.is_file()):
            relative = path.relative_to(source)
            if relative.parts[0].startswith(("_", ".")) or path.suffix == ".lock":
                continue
            dest = dest_top / relative
            dest.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix == ".safetensors":
                tensors = {
                    k: (v.to(torch.float16) if v.dtype == torch.float32 else v).contiguous()
                    for k, v in load_file(str(path)).items()
                }
                save_file(tensors, str(dest), metadata={"format": "pt"})
            else:
                shutil.copyfile(path, dest)
            files[f"{top}/{relative.as_posix()}"] = sha256_of(dest)
    manifest = {
        "about": "sha256 of every shipped demo model file; speculation.offline.demo.shipped checks them",
        "files": dict(sorted(files.items())),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    from speculation.offline.demo.build import DEMO_VERSION, RECIPES, ace_home

    parser = argparse.ArgumentParser(prog="python -m speculation.offline.demo.shipped", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("action", choices=["export"])
    parser.add_argument("--version", default=DEMO_VERSION)
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR)
    args = parser.parse_args(argv)
    if args.version not in RECIPES:
        parser.error(f"unknown demo version {args.version!r} (known: {', '.join(RECIPES)})")
    models_dir = ace_home() / "models"
    if not (models_dir / args.version).is_dir():
        hint = "python -m speculation.offline.eagle.demo_head --variant eagle3-prose"
        print(f"{models_dir / args.version} is not built ({hint})", file=sys.stderr)
        return 2
    manifest = export(args.version, models_dir, args.out)
    size = sum((args.out / name).stat().st_size for name in manifest["files"])
    print(f"exported {args.version} into {args.out}: {len(manifest['files'])} files, {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
