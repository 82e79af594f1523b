"""A reference relay: uvicorn + a bare ASGI app that relays each POST to the upstream with a pooled httpx client,
nothing else (no auth, no routing, no Django). speculation.bench.gateway_overhead --floor serves it beside ACE, so
ACE's cost per request compares with one more Python process and a general-purpose client on the path.

    ACE_RELAY_UPSTREAM=http://127.0.0.1:PORT uvicorn speculation.bench.relay_floor:app
"""

from __future__ import annotations

import os

import httpx

UPSTREAM = os.environ.get("ACE_RELAY_UPSTREAM", "")
_client: httpx.AsyncClient | None = None


async def app(scope: dict, receive, send) -> None:
    global _client
    if scope["type"] != "http":
        return
    if _client is None:
        _client = httpx.AsyncClient(base_url=UPSTREAM, timeout=30)
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    response = await _client.post(scope["path"], content=b"".join(chunks), headers={"content-type": "application/json"})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(response.content)).encode())]
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.content})
