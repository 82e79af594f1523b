"""The Content-Security-Policy header on ACE's pages (Django 5.2 sets none itself).

Scripts only from ACE's own static files (no inline script anywhere: chart data travels in `json_script` blocks,
which are data, and Swagger UI is served by drf-spectacular's split view, whose start-up script is a file too).
Inline styles stay allowed: Plotly styles the charts it draws through style attributes and a <style> element.
No frames, plugins, other origins, or forms posting elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

from django.http import HttpRequest, HttpResponse

POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data: blob:",
        "font-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
HEADER = "Content-Security-Policy"


class ContentSecurityPolicyMiddleware:
    """Adds POLICY to every HTML answer that has none of its own."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if HEADER not in response and response.get("Content-Type", "").startswith("text/html"):
            response[HEADER] = POLICY
        return response
