"""Model directories on disk: where they may lie (the model roots) and whether they hold a model ACE can load.

Everything here runs in the web process without torch: it reads config.json, the safetensors headers (never a
tensor) and tokenizer.json, so a malformed folder is a 400 naming the file and the problem when it is
registered, not a worker traceback later.

A path outside ACE_MODEL_ROOTS gets one message whether or not it exists: the server's file system is not
something an API caller may explore.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError

from speculation.engine.errors import ModelFormatError
from speculation.engine.families import args_from_config, implementation_of, refusal

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
# safetensors' own limit on the JSON header; a larger length field is a corrupt (or hostile) file.
SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
DTYPE_BYTES = {
    **{"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1},
    **{"I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1},
}
# What speculation.engine.loader needs from a config.json (the engine loads targets and drafts); which families and
# variants it runs is speculation.engine.families' to say.
ENGINE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)
# Upper bounds of a config's sizes, far above any released model: a larger value is a corrupt or hostile file (a
# vocab_size of 10**12 would size the engine's buffers, and overflow the database's integer column).
CONFIG_SIZE_LIMITS = {
    "vocab_size": 2**21,
    "hidden_size": 2**16,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "intermediate_size": 2**20,
    "max_position_embeddings": 2**24,
}


@dataclass(frozen=True)
class ModelFacts:
    directory: Path
    config: dict[str, Any]
    param_count: int
    weight_bytes: int
    tokenizer_fingerprint: str


def _refuse(field: str, message: str) -> ValidationError:
    return ValidationError({field: [message]})


def model_roots() -> list[Path]:
    return [Path(root) for root in settings.MODEL_ROOTS]


def under_roots(path: str, *, field: str) -> Path:
    """The canonical path (symlinks resolved) if it lies under a model root; else a ValidationError that says
    the same thing whether the path exists or not."""
    roots = model_roots()
    outside = _refuse(
        field,
        f"{field} must lie under the model roots ({os.pathsep.join(str(r) for r in roots)}; ACE_MODEL_ROOTS)",
    )
    if not isinstance(path, str) or not path.strip() or "\x00" in path:
        raise outside
    real = Path(os.path.realpath(Path(path.strip()).expanduser()))
    if not real.is_absolute() or not any(real == root or real.is_relative_to(root) for root in roots):
        raise outside
    return real


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_config(directory: Path, *, field: str, llama: bool) -> dict[str, Any]:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise _refuse(field, f"{directory} is not a model directory: it holds no {CONFIG_FILE}")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(field, f"{CONFIG_FILE} is not JSON: {exc}") from exc
    except OSError as exc:
        raise _refuse(field, f"{CONFIG_FILE} cannot be read: {exc.strerror}") from exc
    if not isinstance(config, dict):
        raise _refuse(field, f"{CONFIG_FILE} must be a JSON object, not a {type(config).__name__}")
    if "vocab_size" in config and not (_is_int(config["vocab_size"]) and config["vocab_size"] > 0):
        raise _refuse(field, f"{CONFIG_FILE}: vocab_size must be a positive integer, not {config['vocab_size']!r}")
    for key, limit in CONFIG_SIZE_LIMITS.items():
        if _is_int(config.get(key)) and config[key] > limit:
            raise _refuse(field, f"{CONFIG_FILE}: {key} must be at most {limit}, not {config[key]}")
    if llama:
        reason = refusal(config)
        if reason:
            raise _refuse(field, f"{CONFIG_FILE}: {reason}")
        if implementation_of(config.get("model_type")) == "generic":  # transformers' model reads its own config
            return config
        for key in ENGINE_INT_FIELDS:
            if not (_is_int(config.get(key)) and config[key] > 0):
                raise _refuse(field, f"{CONFIG_FILE}: {key} must be a positive integer, not {config.get(key)!r}")
        if not config.get("head_dim") and config["hidden_size"] % config["num_attention_heads"]:
            raise _refuse(field, f"{CONFIG_FILE}: hidden_size is not a multiple of num_attention_heads")
        try:
            args_from_config(config)  # rope scaling, activation, biases: what the engine would refuse at load
        except ModelFormatError as exc:
            raise _refuse(field, f"{CONFIG_FILE}: {exc}") from exc
    return config


def _tensor_error(file: Path, name: str, problem: str) -> str:
    return f"{file.name}: tensor {name[:80]!r}: {problem}"


def safetensors_header(file: Path, *, field: str) -> dict[str, Any]:
    """The parsed, checked header of one safetensors file (no tensor data is read)."""
    try:
        size = file.stat().st_size
        with file.open("rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise _refuse(field, f"{file.name}: truncated: shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > SAFETENSORS_MAX_HEADER:
                raise _refuse(field, f"{file.name}: header length {header_len} exceeds safetensors' 100 MB limit")
            if 8 + header_len > size:
                raise _refuse(
                    field, f"{file.name}: truncated: header length {header_len} exceeds the file size ({size} bytes)"
                )
            raw = fh.read(header_len)
    except OSError as exc:
        raise _refuse(field, f"{file.name} cannot be read: {exc.strerror}") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(field, f"{file.name}: the header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise _refuse(field, f"{file.name}: the header must be a JSON object")
    data_bytes = size - 8 - header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise _refuse(field, _tensor_error(file, name, "its entry is not an object"))
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dtype not in DTYPE_BYTES:
            raise _refuse(field, _tensor_error(file, name, f"unknown dtype {dtype!r}"))
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _refuse(field, _tensor_error(file, name, "missing or invalid shape (a list of sizes)"))
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise _refuse(field, _tensor_error(file, name, "missing or invalid data_offsets"))
        begin, end = offsets
        count = 1
        for dim in shape:
            count *= dim
        if not 0 <= begin <= end <= data_bytes:
            raise _refuse(field, _tensor_error(file, name, f"data_offsets {offsets} lie outside the file (truncated?)"))
        if end - begin != count * DTYPE_BYTES[dtype]:
            raise _refuse(field, _tensor_error(file, name, f"data_offsets {offsets} do not match shape {shape}"))
    return header


def weights_size(directory: Path, *, field: str) -> tuple[int, int]:
    """(parameter count, weight bytes) over every *.safetensors file, from the checked headers."""
    params = nbytes = 0
    for file in sorted(p for p in directory.glob("*.safetensors") if p.is_file()):
        for name, info in safetensors_header(file, field=field).items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            params += count
            nbytes += count * DTYPE_BYTES[info["dtype"]]
    if not params:
        raise _refuse(field, f"{directory} holds no *.safetensors weights")
    return params, nbytes


@lru_cache(maxsize=64)
def _fingerprint(file: Path, mtime_ns: int, size: int) -> str:
    from tokenizers import Tokenizer

    from fleet.probing import CANARY_TEXT, fingerprint_token_ids

    tokenizer = Tokenizer.from_file(str(file))
    return fingerprint_token_ids(tokenizer.encode(CANARY_TEXT, add_special_tokens=True).ids)


def tokenizer_fingerprint(directory: Path, *, field: str) -> str:
    """The fingerprint the probe computes for a server's tokenizer, from the directory's tokenizer.json."""
    file = directory / TOKENIZER_FILE
    if not file.is_file():
        raise _refuse(field, f"{directory} holds no {TOKENIZER_FILE} (a fast tokenizer is required)")
    try:
        stat = file.stat()
        return _fingerprint(file, stat.st_mtime_ns, stat.st_size)
    except Exception as exc:  # tokenizers raises its own exception type for every malformed file
        raise _refuse(field, f"{TOKENIZER_FILE} cannot be loaded: {str(exc)[:200]}") from exc


def inspect_model_dir(path: str, *, field: str, llama: bool) -> ModelFacts:
    """Check a model directory under the roots: config.json, safetensors headers, tokenizer.json.

    llama: the engine loads it (targets and draft models): its config must be of a family the engine runs
    (speculation.engine.families: Llama, Mistral, Qwen 2/3, Gemma 2/3, Phi-3 natively; another dense decoder-only
    causal LM through transformers' model).
    """
    directory = under_roots(path, field=field)
    if not directory.is_dir():
        raise _refuse(field, f"{directory} is not a directory")
    config = read_config(directory, field=field, llama=llama)
    params, nbytes = weights_size(directory, field=field)
    fingerprint = tokenizer_fingerprint(directory, field=field)
    return ModelFacts(directory, config, params, nbytes, fingerprint)
