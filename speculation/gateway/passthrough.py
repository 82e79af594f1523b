"""Forward a request to its endpoint and send the answer back as it comes (bytes untouched by default), through
the lean keep-alive client fleet.http1.

An optional Observer sees the response (to count tokens or capture token ids) and may rewrite it; off mode
passes none, so its path is: build request, send, relay bytes (with the goodput guard on, its observer only
finds the token count: speculation.gateway.goodput.watch).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Protocol

import httpx
from django.http import HttpResponse, StreamingHttpResponse

from fleet import http1, netpolicy
from speculation.gateway import goodput
from speculation.gateway.call import Call
from speculation.gateway.errors import REQUEST_ID_HEADER, error_event, error_response
from speculation.gateway.routes import route_cache

logger = logging.getLogger(__name__)

JSON = "application/json"


class Observer(Protocol):
    def on_body(self, status: int, body: bytes) -> bytes:
        """Non-streaming: see (and possibly rewrite) the whole body."""

    def on_chunk(self, chunk: bytes) -> bytes:
        """Streaming: see (and possibly rewrite) one raw chunk of the event stream."""

    async def on_done(self, status: int, error: str = "") -> None:
        """After the last byte went out (or the upstream failed: error says why)."""


def _headers(call: Call) -> dict[str, str]:
    return {**call.route.upstream_headers, "Content-Type": JSON}


async def forward(call: Call, *, content: bytes | None = None, observer: Observer | None = None):
    """Send `content` (default: the client's request) to the endpoint and relay the answer (an off or shadow
    request's speed is kept as a plain sample of the goodput guard)."""
    observer = goodput.watch(call, observer)
    content = content if content is not None else call.upstream_bytes()
    await follow_move(call)
    try:
        response = await _send(call, content)
    except httpx.HTTPError as exc:
        logger.warning("request %s: endpoint %s unreachable: %s", call.request_id, call.route.name, exc)
        if observer is not None:
            await observer.on_done(502, f"endpoint unreachable: {type(exc).__name__}")
        why = "refused by ACE's network policy" if netpolicy.refusal(exc) else type(exc).__name__
        return error_response(
            502,
            f"endpoint {call.route.name} unreachable: {why}",
            code="upstream_unreachable",
            request_id=call.request_id,
        )
    content_type = response.headers.get("content-type", JSON)
    if not call.stream or response.status_code != 200:  # an error is one JSON body, to a stream request too
        body = await response.aread()
        await response.aclose()
        if observer is not None:
            body = observer.on_body(response.status_code, body)
            await observer.on_done(response.status_code)
        reply = HttpResponse(body, status=response.status_code, content_type=content_type)
        reply[REQUEST_ID_HEADER] = call.request_id
        return reply
    reply = StreamingHttpResponse(_relay(response, observer), status=response.status_code, content_type=content_type)
    reply[REQUEST_ID_HEADER] = call.request_id
    reply["Cache-Control"] = "no-cache"
    return reply


async def follow_move(call: Call, *, reread: bool = False) -> bool:
    """Send the request where its endpoint is routed now: a managed endpoint's blue/green switch (fleet.managed) may
    have moved it to a new instance since the request looked its route up, and the old one stops once drained.
    True when it moved (`reread`: see RouteCache.current)."""
    now = await route_cache().current(call.route, reread=reread)
    if now.base_url == call.route.base_url:
        return False
    logger.info("request %s: endpoint %s moved to %s; sent there", call.request_id, call.route.name, now.base_url)
    call.route = dataclasses.replace(
        call.route, base_url=now.base_url, api_key=now.api_key, upstream_headers=now.upstream_headers
    )
    return True


# The connection dropped before any response: most often a pooled keep-alive connection the server closed as the
# request went out (seen in a bench: vLLM healthy, one off-mode request of thousands answered 502). Sent once more on
# a fresh connection; a completion has no side effect but the server's work.
RESENT_AFTER = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# Nothing was answered: when the endpoint has moved meanwhile (its old instance stopped after a switch this process
# had not heard of yet), the request goes to where it is routed now.
UNANSWERED = (httpx.ConnectError, *RESENT_AFTER)


async def _send(call: Call, content: bytes) -> http1.Response:
    try:
        return await _post(call, content)
    except UNANSWERED:
        if not await follow_move(call, reread=True):
            raise
        return await _post(call, content)


async def _post(call: Call, content: bytes) -> http1.Response:
    headers = _headers(call)
    try:
        return await http1.pool().post(call.url, content=content, headers=headers)
    except RESENT_AFTER as exc:
        logger.info("request %s: connection to %s dropped (%s); sent again", call.request_id, call.route.name, exc)
        return await http1.pool().post(call.url, content=content, headers=headers)


async def _relay(response: http1.Response, observer: Observer | None) -> AsyncIterator[bytes]:
    error = ""
    try:
        if observer is None:
            async for chunk in response.aiter_raw():
                yield chunk
        else:
            async for chunk in response.aiter_raw():
                yield observer.on_chunk(chunk)
    except httpx.HTTPError as exc:
        error = f"endpoint stream broke: {type(exc).__name__}"
        logger.warning("stream from upstream broke: %s", exc)
        # Without it the client would see a stream that just stops (no [DONE]) and could take it as complete.
        yield error_event(f"the endpoint's stream broke off: {type(exc).__name__}", code="upstream_stream_broken")
    finally:
        # The observer first: when the client disconnects the task is cancelled, and an await here may not
        # come back; observers only spawn their writes.
        if observer is not None:
            await observer.on_done(response.status_code, error)
        await response.aclose()
