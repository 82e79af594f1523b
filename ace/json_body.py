"""JSON request bodies with a bounded nesting depth, for the REST API (DRF's default parser) and the gateway.

Python's decoder raises RecursionError for a body nested about a thousand levels deep, which DRF's own parser
lets escape (a 500); one a little shallower decodes, then recurses in the serializers or the JSON encoder.
No request ACE accepts nests beyond a few levels, so a body deeper than MAX_DEPTH is refused before anything
reads it, with a message naming the limit.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings
from rest_framework import parsers
from rest_framework.exceptions import APIException, ParseError
from rest_framework.utils import json as drf_json

MAX_DEPTH = 64


class TooDeep(ValueError):
    """The JSON nests arrays and objects deeper than MAX_DEPTH."""


def depth_problem(value: Any, *, limit: int = MAX_DEPTH) -> str:
    """Why `value` (decoded JSON) nests too deep ("" when it does not); iterative, so any depth is safe."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return f"JSON nested deeper than {limit} levels"
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return ""


def loads(raw: bytes | str, *, limit: int = MAX_DEPTH, **options: Any) -> Any:
    """json.loads(raw, **options), raising TooDeep (a ValueError) for a body nested deeper than `limit`."""
    try:
        value = json.loads(raw, **options)
    except RecursionError as exc:
        raise TooDeep(f"JSON nested deeper than {limit} levels") from exc
    problem = depth_problem(value, limit=limit)
    if problem:
        raise TooDeep(problem)
    return value


class BodyTooLarge(APIException):
    status_code = 413
    default_code = "request_too_large"

    @classmethod
    def over_limit(cls) -> BodyTooLarge:
        return cls(f"The body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes (ACE_MAX_BODY_BYTES).")


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, bounded: a body nested deeper than MAX_DEPTH is a 400 naming the limit (never a
    RecursionError), and one over ACE_MAX_BODY_BYTES a 413. Django refuses a larger Content-Length before this
    reads anything (ace.api.exception_handler answers that as the same JSON 413); a chunked body has none."""

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        raw = stream.read()
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        if limit is not None and len(raw) > limit:
            raise BodyTooLarge.over_limit()
        try:
            strict = {"parse_constant": drf_json.strict_constant} if self.strict else {}
            return loads(raw.decode(encoding), **strict)
        except TooDeep as exc:
            raise ParseError(f"JSON parse error - {exc}.") from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
