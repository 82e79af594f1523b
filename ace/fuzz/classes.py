"""Input classes sent on purpose, not left to chance: each once made ACE answer 500 where a 400 was due.

- deep nesting: JSON arrays about 1,000 deep (Python's decoder raises RecursionError) and values 100 deep;
- Unicode digits and look-alikes: superscripts, fullwidth, Arabic-Indic, circled and mathematical digits
  (str.isdigit() accepts some that int() refuses, and int() reads others as numbers), and "nan", "inf" and
  "1e999", which float() reads as numbers JSON cannot carry;
- impossible dates: month 13, 30 February, hour 25 (they match the ISO pattern, then datetime() raises);
- control and invisible characters: CR/LF, TAB, NUL, ESC, DEL, a space, a broken %-escape, U+202E, U+2028,
  zero-width space and BOM, in every string field and query parameter.

`rest_cases` turns ACE's OpenAPI schema into requests carrying them (every operation: each query parameter,
each body field, the path id, and the whole body nested too deep); ace.fuzz.gateway puts them in the
gateway's bodies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

DEEP_JSON = b"[" * 1000 + b"]" * 1000


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


UNICODE_DIGITS = ["\u00b2", "\uff11\uff12", "\u0663", "\u2460", "1\u00b2", "\U0001d7d9", "\u2077", "\uff17"]
NUMBER_WORDS = ["nan", "inf", "-inf", "1e999"]  # float() reads them; JSON cannot carry the result
IMPOSSIBLE_DATES = ["2026-13-45T00:00:00Z", "2026-02-30T00:00:00Z", "2026-01-01T25:61:61Z", "0000-00-00T00:00:00Z"]
CONTROL_STRINGS = [
    *("a\r\nb", "a\tb", "a\x00b", "\x1b[31mred", "a\x7f", "a b", "a%zzb", "\u202egnp.exe"),
    *("a\u2028b", "a\u200bb", "\ufeffa", "http://127.0.0.1:9/a\r\nb"),
]
QUERY_VALUES: list[str] = [
    *UNICODE_DIGITS,
    *NUMBER_WORDS,
    *IMPOSSIBLE_DATES,
    *(s for s in CONTROL_STRINGS if "\x00" not in s),
]
FIELD_VALUES: list[Any] = [*CONTROL_STRINGS, *UNICODE_DIGITS, *IMPOSSIBLE_DATES[:1], nested(100)]
WRITES = ("post", "put", "patch")


@dataclass(frozen=True)
class Case:
    method: str
    path: str  # with the query string
    body: bytes | None = None
    label: str = ""


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref", "")
    if ref.startswith("#/components/schemas/"):
        return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]
    return node


def _body_fields(schema: dict[str, Any], operation: dict[str, Any]) -> list[str]:
    content = operation.get("requestBody", {}).get("content", {})
    body = content.get("application/json", {}).get("schema")
    if not body:
        return []
    return sorted(_resolve(schema, body).get("properties", {}))


def rest_cases(schema: dict[str, Any], *, path_id: int, quick: bool) -> Iterator[Case]:
    """Every operation of `schema` with each class in each query parameter, each body field and the path id
    (`path_id`: an id that exists, for the other cases; DELETE only ever gets odd ids), and a body nested too
    deep. `quick`: the first value of each class per parameter or field."""
    query_values = QUERY_VALUES[::4] if quick else QUERY_VALUES
    field_values = FIELD_VALUES[::3] + [FIELD_VALUES[-1]] if quick else FIELD_VALUES
    for template, operations in sorted(schema.get("paths", {}).items()):
        for method, operation in sorted(operations.items()):
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            params = operation.get("parameters", [])
            has_id = any(p["in"] == "path" for p in params)
            path = _fill(template, str(path_id))
            for odd in UNICODE_DIGITS[: 2 if quick else None] if has_id else []:
                yield Case(method, _fill(template, quote(odd)), label=f"{method} {template} id={odd!r}")
            if method == "delete":
                continue
            for param in (p["name"] for p in params if p["in"] == "query"):
                for value in query_values:
                    query = f"?{quote(param)}={quote(value, safe='')}"
                    yield Case(method, path + query, label=f"{method} {template} ?{param}={value!r}")
            if method in WRITES:
                yield Case(method, path, DEEP_JSON, label=f"{method} {template} body nested 1000 deep")
                for name in _body_fields(schema, operation):
                    for value in field_values:
                        body = json.dumps({name: value}).encode()
                        yield Case(method, path, body, label=f"{method} {template} {name}={str(value)[:40]!r}")


def _fill(template: str, value: str) -> str:
    out, rest = "", template
    while "{" in rest:
        head, _, tail = rest.partition("{")
        out += head + value
        rest = tail.partition("}")[2]
    return out + rest


def gateway_changes(kind: str) -> list[tuple[str, Any]]:
    """(field, value) pairs for the gateway's bodies: control strings in its string fields, Unicode digits in its
    numbers, and values nested 100 deep."""
    strings = ["model", "prompt", "user", "stop", "suffix"] if kind == "completion" else ["model", "user", "stop"]
    numbers = ["max_tokens", "n", "seed", "top_k", "logprobs" if kind == "completion" else "top_logprobs"]
    changes: list[tuple[str, Any]] = [(name, value) for name in strings for value in CONTROL_STRINGS]
    if kind == "chat":
        for value in CONTROL_STRINGS:
            changes.append(("messages", [{"role": "user", "content": value}]))
            changes.append(("messages", [{"role": value, "content": "hi"}]))
    changes += [(name, value) for name in numbers for value in UNICODE_DIGITS]
    changes += [(name, nested(100)) for name in ("prompt", "stop", "response_format", "logit_bias", "messages")]
    return changes
