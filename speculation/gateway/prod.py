"""Prod mode: tokens come from draft + verify in the endpoint's GPU worker, streamed back through Redis.

Requests prod cannot serve exactly go plain (skipped + reason). When the speculative path fails (Redis down,
no worker, timeout, draft error) the request is answered by plain generation (fell_back + reason): from
scratch when nothing was sent yet, or, mid-stream, by letting the endpoint continue greedily from the tokens
already committed (exact at temperature 0, the only prod case).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse

from speculation.gateway import native, passthrough, upstream
from speculation.gateway.call import Call
from speculation.gateway.channel import ChannelError, GatewayChannel
from speculation.gateway.errors import REQUEST_ID_HEADER
from speculation.gateway.exactness import unservable_reason
from speculation.gateway.openai_format import Shape
from speculation.gateway.recording import PlainRecorder
from speculation.gateway.sse import DONE, EventSplitter, dumps, payload_of
from speculation.models import Action, VerificationPath
from speculation.services.records import keep_record

logger = logging.getLogger(__name__)

START_TIMEOUT_S = settings.PROD_START_TIMEOUT_S
STEP_TIMEOUT_S = settings.PROD_STEP_TIMEOUT_S
DEFAULT_MAX_CONTEXT = 2048


async def plain(call: Call, *, action: str, reason: str, extra: dict | None = None):
    logger.info("request %s to %s goes plain (%s): %s", call.request_id, call.route.name, action, reason)
    return await passthrough.forward(call, observer=PlainRecorder(call, action=action, reason=reason, extra=extra))


class UpstreamError(RuntimeError):
    pass


async def _post_json(call: Call, path: str, payload: dict[str, Any]) -> dict[str, Any]:
    try:
        response = await upstream.client().post(
            call.route.base_url + path,
            content=dumps(payload).encode(),
            headers={**call.route.upstream_headers, "Content-Type": "application/json"},
        )
    except httpx.HTTPError as exc:
        raise UpstreamError(f"{path}: {type(exc).__name__}") from exc
    if response.status_code != 200:
        raise UpstreamError(f"{path}: HTTP {response.status_code}: {response.text[:200]}")
    return response.json()


async def prompt_token_ids(call: Call) -> list[int]:
    """The prompt as the target tokenizes it (chat template applied by the server itself)."""
    if call.kind == "completion" and isinstance(call.body.get("prompt"), list):
        return [int(t) for t in call.body["prompt"]]
    if call.kind == "chat":
        payload = {"model": call.upstream_model, "messages": call.body["messages"], "add_generation_prompt": True}
    else:
        payload = {"model": call.upstream_model, "prompt": call.body["prompt"]}
    return [int(t) for t in (await _post_json(call, "/tokenize", payload))["tokens"]]


async def serve(call: Call):
    route = call.route
    reason = unservable_reason(call.body, kind=call.kind)
    if reason:
        return await plain(call, action=Action.SKIPPED, reason=reason)
    if route.path == VerificationPath.NATIVE:
        return await native.serve(call)
    if route.path not in (VerificationPath.REMOTE, VerificationPath.LOCAL):
        return await plain(call, action=Action.SKIPPED, reason="no verification path fits this endpoint")
    try:
        prompt_ids = await prompt_token_ids(call)
    except (UpstreamError, KeyError, ValueError) as exc:
        return await plain(call, action=Action.FELL_BACK, reason=f"tokenize failed: {exc}")
    max_context = int(route.capabilities.get("max_context") or DEFAULT_MAX_CONTEXT)
    asked = call.body.get("max_completion_tokens") or call.body.get("max_tokens")
    max_tokens = int(asked) if asked else max_context - len(prompt_ids)
    if len(prompt_ids) + max_tokens > max_context or max_tokens < 1:
        return await plain(
            call,
            action=Action.SKIPPED,
            reason=f"too long: {len(prompt_ids)} prompt + {max_tokens} new tokens > context {max_context}",
        )
    channel = GatewayChannel(call.request_id)
    job = {
        "request_id": call.request_id,
        "endpoint_id": route.endpoint_id,
        "prompt_ids": prompt_ids,
        "max_tokens": max_tokens,
        "k": route.k,
        "path": route.path,
    }
    try:
        await channel.check()
        from speculation.tasks import enqueue_prod

        await asyncio.to_thread(enqueue_prod, job=job, node_class=route.node_class, expires_s=START_TIMEOUT_S)
    except ChannelError as exc:
        return await plain(call, action=Action.FELL_BACK, reason=str(exc))
    except Exception as exc:  # noqa: BLE001 - whatever the broker raises, the client gets a plain answer
        return await plain(call, action=Action.FELL_BACK, reason=f"could not enqueue: {type(exc).__name__}: {exc}")
    try:
        first = await channel.receive(START_TIMEOUT_S)
    except ChannelError as exc:
        return await plain(call, action=Action.FELL_BACK, reason=str(exc))
    if first is None:
        await channel.discard()
        return await plain(
            call,
            action=Action.FELL_BACK,
            reason=f"no worker on gpu.{route.node_class} took the request within {START_TIMEOUT_S:g} s",
        )
    if first.get("type") == "error":
        return await plain(call, action=Action.FELL_BACK, reason=first.get("reason", "worker error"))
    shape = Shape(
        kind=call.kind,
        request_id=call.request_id,
        model=call.upstream_model,
        prompt_ids=prompt_ids,
        return_token_ids=bool(call.body.get("return_token_ids")),
        include_usage=bool((call.body.get("stream_options") or {}).get("include_usage")),
    )
    run = ProdRun(call=call, channel=channel, shape=shape, prompt_ids=prompt_ids, max_tokens=max_tokens)
    if call.stream:
        reply = StreamingHttpResponse(run.stream(), content_type="text/event-stream; charset=utf-8")
        reply[REQUEST_ID_HEADER] = call.request_id
        reply["Cache-Control"] = "no-cache"
        return reply
    return await run.whole()


class ProdRun:
    def __init__(
        self, *, call: Call, channel: GatewayChannel, shape: Shape, prompt_ids: list[int], max_tokens: int
    ) -> None:
        self.call = call
        self.channel = channel
        self.shape = shape
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.ids: list[int] = []
        self.text = ""
        self.finish_reason = ""
        self.stats: dict[str, Any] = {}
        self.failure = ""
        self.recorded = False

    async def messages(self) -> AsyncIterator[dict[str, Any]]:
        """Token messages until done; on failure sets self.failure and stops."""
        while True:
            try:
                message = await self.channel.receive(STEP_TIMEOUT_S)
            except ChannelError as exc:
                self.failure = f"{exc} after {len(self.ids)} tokens"
                return
            if message is None:
                self.failure = f"worker sent nothing for {STEP_TIMEOUT_S:g} s after {len(self.ids)} tokens"
                await self.channel.discard()
                return
            kind = message.get("type")
            if kind == "tokens":
                self.ids.extend(message["ids"])
                self.text += message.get("text", "")
                yield message
            elif kind == "done":
                self.finish_reason = message.get("finish_reason", "length")
                self.stats = message.get("stats", {})
                tail = message.get("text", "")
                self.text += tail
                if tail:
                    yield {"type": "tokens", "ids": [], "text": tail}
                return
            elif kind == "error":
                self.failure = f"{message.get('reason', 'worker error')} (after {len(self.ids)} tokens)"
                return

    def _record(self) -> None:
        """Written once, as soon as the outcome is known (before the last bytes go out)."""
        if self.recorded:
            return
        self.recorded = True
        latency_ms = self.call.elapsed_ms()
        route = self.call.route
        common = {"path": route.path, "mechanism": route.mechanism, "k": route.k, "latency_ms": latency_ms}
        if self.failure:
            tokens = len(self.ids)
            keep_record(
                endpoint_id=route.endpoint_id,
                request_id=self.call.request_id,
                mode=route.mode,
                action=Action.FELL_BACK,
                reason=self.failure,
                output_tokens=tokens,
                **common,
            )
            return
        keep_record(
            endpoint_id=route.endpoint_id,
            request_id=self.call.request_id,
            mode=route.mode,
            action=Action.SPECULATED,
            output_tokens=len(self.ids),
            **{**common, **self.stats},
        )

    async def whole(self):
        async for _ in self.messages():
            pass
        if self.failure:
            return await plain(self.call, action=Action.FELL_BACK, reason=self.failure)
        self._record()
        reply = HttpResponse(
            dumps(self.shape.response(self.text, self.ids, self.finish_reason)).encode(),
            content_type="application/json",
        )
        reply[REQUEST_ID_HEADER] = self.call.request_id
        return reply

    async def stream(self) -> AsyncIterator[bytes]:
        first = self.shape.first_chunk()
        if first:
            yield first
        sent_any = False
        try:
            async for message in self.messages():
                if message["ids"] or message.get("text"):
                    yield self.shape.chunk(message.get("text", ""), message["ids"], first=not sent_any)
                    sent_any = True
            if self.failure:
                async for piece in self._continue_plain(first_sent=sent_any):
                    yield piece
                self._record()
            else:
                self._record()
                yield self.shape.chunk("", [], finish_reason=self.finish_reason, first=not sent_any)
            yield self.shape.usage_chunk(len(self.ids))
            yield DONE
        finally:
            if not self.recorded:
                if not self.failure and not self.finish_reason:
                    self.failure = f"client went away after {len(self.ids)} tokens"
                self._record()

    async def _continue_plain(self, *, first_sent: bool) -> AsyncIterator[bytes]:
        """Let the endpoint finish greedily from the committed tokens (the prod request is greedy)."""
        remaining = self.max_tokens - len(self.ids)
        logger.warning(
            "request %s: speculative path failed (%s); continuing plain for %d tokens",
            self.call.request_id,
            self.failure,
            remaining,
        )
        if remaining <= 0:
            yield self.shape.chunk("", [], finish_reason="length", first=not first_sent)
            return
        payload = {
            "model": self.call.upstream_model,
            "prompt": self.prompt_ids + self.ids,
            "max_tokens": remaining,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
        }
        splitter = EventSplitter()
        finish = None
        try:
            async with upstream.client().stream(
                "POST",
                self.call.route.base_url + "/v1/completions",
                content=dumps(payload).encode(),
                headers={**self.call.route.upstream_headers, "Content-Type": "application/json"},
            ) as response:
                async for chunk in response.aiter_raw():
                    for raw in splitter.feed(chunk):
                        data = payload_of(raw)
                        if not data or not data.get("choices"):
                            continue
                        choice = data["choices"][0]
                        ids = choice.get("token_ids") or []
                        self.ids.extend(ids)
                        self.text += choice.get("text", "")
                        finish = choice.get("finish_reason")
                        yield self.shape.chunk(choice.get("text", ""), ids, finish_reason=finish, first=not first_sent)
                        first_sent = True
        except httpx.HTTPError as exc:
            self.failure += f"; plain continuation failed too: {type(exc).__name__}"
        if finish is None:
            yield self.shape.chunk("", [], finish_reason="length", first=not first_sent)
