"""Errors in the OpenAI shape (`{"error": {"message", "type", "code"}}`), which the openai client raises from."""

from __future__ import annotations

import json

from django.http import HttpResponse

REQUEST_ID_HEADER = "X-ACE-Request-Id"


def error_response(
    status: int, message: str, *, code: str, request_id: str, kind: str = "", param: str | None = None
) -> HttpResponse:
    payload = {
        "error": {
            "message": message,
            "type": kind or ("invalid_request_error" if status < 500 else "upstream_error"),
            "param": param,
            "code": code,
        }
    }
    response = HttpResponse(json.dumps(payload), status=status, content_type="application/json")
    response[REQUEST_ID_HEADER] = request_id
    return response


def error_event(message: str, *, code: str, kind: str = "upstream_error") -> bytes:
    """The same error as one server-sent event, for a stream that cannot be finished (the openai client raises it)."""
    payload = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n"
