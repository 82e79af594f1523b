"""REST token authentication (DRF's TokenAuthentication) with the bad-token throttle of ace.throttle.

Its own module: DRF imports the classes its settings name while ace.api is still being imported.
"""

from __future__ import annotations

from rest_framework.authentication import TokenAuthentication, get_authorization_header
from rest_framework.exceptions import AuthenticationFailed, Throttled

from ace import throttle


class ThrottledTokenAuthentication(TokenAuthentication):
    """DRF's token authentication, throttled per client address (ace.throttle.tokens): once it sent
    ACE_TOKEN_THROTTLE bad tokens within ACE_THROTTLE_WINDOW seconds, any token it sends is a 429 until then."""

    def authenticate(self, request):
        parts = get_authorization_header(request).split()
        if not parts or parts[0].lower() != self.keyword.lower().encode():
            return None
        client = request.META.get("REMOTE_ADDR", "")
        wait = throttle.tokens.wait_s(client)
        if wait:
            raise Throttled(wait, detail=throttle.wait_message(wait))
        try:
            return super().authenticate(request)
        except AuthenticationFailed:
            throttle.tokens.failed(client)
            raise
