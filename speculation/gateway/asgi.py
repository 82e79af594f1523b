"""The lean ASGI app that serves /v1 beside Django (ace.asgi routes those three paths here, the rest to Django).

The same gateway code as the Django views (speculation.gateway.views: authenticate, route, validate, then off,
shadow or prod), without what /v1 does not use: no middleware chain (sessions, CSRF, auth, messages: each of
them a hop to Django's sync thread under ASGI), no request signals, no per-request executor thread. What the
middleware did that /v1 needs is done here: the Host header is checked against ALLOWED_HOSTS, the body is
bounded by DATA_UPLOAD_MAX_MEMORY_SIZE, and the security headers of Django's SecurityMiddleware and
XFrameOptionsMiddleware are set. The gateway version is followed as it is published (no Redis read per
request: speculation.gateway.freshness). A client that disconnects cancels the request's task, as Django does (prod
reads that as "the client went away").
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

from django.conf import settings
from django.http import HttpResponseBase
from django.http.request import split_domain_port, validate_host

from speculation.gateway import views
from speculation.gateway.call import new_request_id
from speculation.gateway.errors import error_response
from speculation.gateway.routes import route_cache

logger = logging.getLogger(__name__)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}
PATHS = frozenset([*KINDS, "/v1/models"])


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


async def _lifespan(receive: Receive, send: Send) -> None:
    from speculation.gateway.guard import samples
    from speculation.services import captures, records

    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            try:
                await records.aflush()
                await captures.aflush()
                await samples.aflush()
            except Exception:  # noqa: BLE001 - shutdown goes on; what could not be written is logged
                logger.exception("stage records, captures or goodput samples not written at shutdown")
            await send({"type": "lifespan.shutdown.complete"})
            return


def _client(scope: Scope) -> str:
    """The caller's address (what the bad-token throttle counts by; ace.throttle)."""
    return str((scope.get("client") or ("",))[0])


def _security_headers() -> list[tuple[bytes, bytes]]:
    headers = [(b"X-Frame-Options", settings.X_FRAME_OPTIONS.encode())]
    if settings.SECURE_CONTENT_TYPE_NOSNIFF:
        headers.append((b"X-Content-Type-Options", b"nosniff"))
    if settings.SECURE_REFERRER_POLICY:
        headers.append((b"Referrer-Policy", str(settings.SECURE_REFERRER_POLICY).encode()))
    if settings.SECURE_CROSS_ORIGIN_OPENER_POLICY:
        headers.append((b"Cross-Origin-Opener-Policy", settings.SECURE_CROSS_ORIGIN_OPENER_POLICY.encode()))
    return headers


class GatewayApp:
    """Serves PATHS itself and hands every other request to `fallback` (Django); answers the lifespan protocol
    itself (Django does not), writing the queued stage records, captures and goodput samples at shutdown."""

    def __init__(self, fallback: ASGIApp) -> None:
        self.fallback = fallback
        self.security_headers = _security_headers()
        allowed = settings.ALLOWED_HOSTS
        if settings.DEBUG and not allowed:
            allowed = [".localhost", "127.0.0.1", "[::1]"]  # as Django's HttpRequest.get_host
        self.allowed_hosts = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http" or scope["path"] not in PATHS:
            await self.fallback(scope, receive, send)
            return
        headers = {name.lower(): value for name, value in scope["headers"]}
        if not self._host_ok(headers.get(b"host", b"")):
            refused = error_response(400, "Invalid Host header.", code="bad_host", request_id=new_request_id())
            await self._send(refused, send)
            return
        try:
            raw = await self._body(receive, headers)
        except ClientGone:
            return
        await self._serve(scope, receive, send, headers, raw)

    def _host_ok(self, host: bytes) -> bool:
        domain, _ = split_domain_port(host.decode("latin1"))
        return bool(domain) and validate_host(domain, self.allowed_hosts)

    async def _body(self, receive: Receive, headers: dict[bytes, bytes]) -> bytes | None:
        """The whole body, or None when it is larger than the limit (what is left of it is not read)."""
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        declared = headers.get(b"content-length")
        if limit is not None and declared is not None and declared.isdigit() and int(declared) > limit:
            return None
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if limit is not None and size > limit:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, headers: dict, raw: bytes | None) -> None:
        """The request and a listener for the client's disconnect, side by side: whichever ends first ends both."""
        authorization = headers.get(b"authorization", b"").decode("latin1")
        route_cache().follow_bumps()  # a web process reads no Redis per request once subscribed
        workload = headers.get(b"x-ace-workload")  # the request's workload key (speculation.workloads.keys)
        workload_header = workload.decode("latin1") if workload is not None else None
        opt_out = headers.get(b"x-ace-no-capture")  # speculation.gateway.capture.OPT_OUT_HEADER
        no_capture = opt_out.decode("latin1") if opt_out is not None else None
        work = asyncio.create_task(self._answer(scope, send, authorization, raw, workload_header, no_capture))
        listener = asyncio.create_task(_wait_disconnect(receive))
        await asyncio.wait((work, listener), return_when=asyncio.FIRST_COMPLETED)
        for task in (listener, work):
            if not task.done():
                task.cancel()
            try:
                await task
            except (asyncio.CancelledError, ClientGone):
                pass
            except Exception:  # noqa: BLE001 - e.g. the connection broke while the answer was being sent
                logger.exception("gateway: sending the answer failed")

    async def _answer(
        self,
        scope: Scope,
        send: Send,
        authorization: str,
        raw: bytes | None,
        workload_header: str | None = None,
        no_capture: str | None = None,
    ) -> None:
        path = scope["path"]
        try:
            if path == "/v1/models":
                response = await views.list_models(authorization, client=_client(scope))
            else:
                response = await views.serve(
                    kind=KINDS[path],
                    method=scope["method"],
                    authorization=authorization,
                    raw=raw,
                    workload_header=workload_header,
                    client=_client(scope),
                    no_capture=no_capture,
                )
        except Exception:  # noqa: BLE001 - a bug answers an OpenAI-shaped 500 with the request id, never a traceback
            request_id = new_request_id()
            logger.exception("gateway request %s failed", request_id)
            message = f"Internal error in ACE's gateway (request {request_id})."
            response = error_response(500, message, code="internal_error", request_id=request_id)
        await self._send(response, send)

    async def _send(self, response: HttpResponseBase, send: Send) -> None:
        headers = [(str(k).encode("latin1"), str(v).encode("latin1")) for k, v in response.items()]
        headers += self.security_headers
        if not response.streaming:
            body = response.content
            headers.append((b"Content-Length", str(len(body)).encode()))
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        async with aclosing(aiter(response)) as content:
            async for part in content:
                if part:
                    await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body"})


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
