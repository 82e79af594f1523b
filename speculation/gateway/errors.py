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
