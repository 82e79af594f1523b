"""Draft registry: register a draft artifact from a local directory (or an n-gram draft, which has none)."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction

from speculation.models import DraftKind, DraftModel
from speculation.services.fingerprint import tokenizer_fingerprint_of_dir

logger = logging.getLogger(__name__)

# Weights plus activations and a short KV cache: a deliberately simple estimate, stated as such in the API.
VRAM_OVERHEAD = 1.2
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _safetensors_sizes(directory: Path) -> tuple[int, int]:
    """(parameter count, weight bytes) read from the safetensors headers, without loading any tensor."""
    params = 0
    nbytes = 0
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as fh:
            (header_len,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(header_len))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            params += count
            nbytes += count * _DTYPE_BYTES.get(info["dtype"], 4)
    return params, nbytes


def inspect_draft_dir(path: str) -> dict[str, Any]:
    """What a draft directory holds: vocab size, parameter count, VRAM estimate, tokenizer fingerprint."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValidationError({"path": [f"{path!r} is not a directory on this node"]})
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValidationError({"path": [f"{path!r} holds no config.json (a Hugging Face model directory)"]})
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValidationError({"path": [f"config.json is not JSON: {exc}"]}) from exc
    params, nbytes = _safetensors_sizes(directory)
    if not params:
        raise ValidationError({"path": [f"{path!r} holds no *.safetensors weights"]})
    try:
        fingerprint = tokenizer_fingerprint_of_dir(directory)
    except (OSError, ValueError) as exc:
        raise ValidationError({"path": [f"cannot read the tokenizer in {path!r}: {exc}"]}) from exc
    return {
        "vocab_size": config.get("vocab_size"),
        "param_count": params,
        "vram_bytes": int(nbytes * VRAM_OVERHEAD),
        "tokenizer_fingerprint": fingerprint,
        "config": {key: config.get(key) for key in ("model_type", "hidden_size", "num_hidden_layers", "torch_dtype")},
    }


def register_draft(
    *, name: str, kind: str, path: str = "", node_class: str = "cpu", target_name: str = ""
) -> DraftModel:
    """Register a draft; its facts are read from the directory, never taken from the caller."""
    if kind not in DraftKind.values:
        raise ValidationError({"kind": [f"unknown kind {kind!r}: choose one of {', '.join(DraftKind.values)}"]})
    facts: dict[str, Any] = {}
    if kind == DraftKind.NGRAM:
        if path:
            raise ValidationError({"path": ["an n-gram draft has no weights: leave path empty"]})
    else:
        if not path:
            raise ValidationError({"path": [f"a {kind} needs the directory of its weights"]})
        facts = inspect_draft_dir(path)
    draft = DraftModel(name=name, kind=kind, path=path, node_class=node_class, target_name=target_name, **facts)
    try:
        draft.full_clean()
    except ValidationError:
        raise
    try:
        with transaction.atomic():
            draft.save()
    except IntegrityError as exc:
        raise ValidationError({"name": [f"a draft named {name!r} already exists"]}) from exc
    logger.info("draft %s registered (%s, %s params)", name, kind, facts.get("param_count"))
    return draft


def delete_draft(*, draft: DraftModel) -> None:
    if draft.speculationpolicy_set.exists():
        names = ", ".join(p.endpoint.name for p in draft.speculationpolicy_set.select_related("endpoint"))
        raise ValidationError({"draft": [f"draft {draft.name!r} is used by the policy of {names}"]})
    draft.delete()
