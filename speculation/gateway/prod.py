"""Prod mode: tokens come from draft + verify in the endpoint's GPU worker, streamed back through Redis.

Requests prod cannot serve exactly go plain (skipped + reason). When the speculative path fails (Redis down,
no worker, timeout, draft error) the request is answered by plain generation (fell_back + reason): from
scratch when nothing was sent yet, or, mid-stream, by letting the endpoint continue from the tokens already
committed with the request's own sampling (speculation.gateway.sampling says which sampling each path serves).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from django.conf import settings
from django.http import HttpResponse, StreamingHttpResponse

from fleet.adapters import Unsupported, WireError, WireRequest, semantics_for, wire_for
from speculation import openai_fields
from speculation.gateway import admission, goodput, native, passthrough, upstream
from speculation.gateway import sampling as request_sampling
from speculation.gateway.background import spawn
from speculation.gateway.call import Call
from speculation.gateway.channel import ChannelError, GatewayChannel
from speculation.gateway.errors import REQUEST_ID_HEADER, error_event
from speculation.gateway.openai_format import Shape
from speculation.gateway.preflight import max_context as preflight_max_context
from speculation.gateway.preflight import preflight
from speculation.gateway.recording import PlainRecorder
from speculation.gateway.sse import DONE, EventSplitter, dumps, payload_of
from speculation.jobs import queue
from speculation.jobs.channel import Cancelled, Done, Error, Tokens
from speculation.jobs.job import ProdJob
from speculation.models import Action
from speculation.services.records import keep_record

logger = logging.getLogger(__name__)

START_TIMEOUT_S = settings.PROD_START_TIMEOUT_S
STEP_TIMEOUT_S = settings.PROD_STEP_TIMEOUT_S
# Applied by the worker exactly as the server applies them (speculation.worker.paths.stopping).
STOP_FIELDS = openai_fields.STOP
SLOT_SLACK_S = 30.0  # a queued job's slot outlives its queue expiry by this much unless a worker refreshes it


def _failure(message: Error | Cancelled) -> str:
    return message.reason if isinstance(message, Error) else "worker error"


async def plain(call: Call, *, action: str, reason: str, extra: dict | None = None):
    logger.info("request %s to %s goes plain (%s): %s", call.request_id, call.route.name, action, reason)
    return await passthrough.forward(call, observer=PlainRecorder(call, action=action, reason=reason, extra=extra))


class UpstreamError(RuntimeError):
    pass


async def _send(call: Call, request: WireRequest) -> Any:
    """One request of the endpoint's wire format (fleet.adapters.wire), its answer decoded from JSON."""
    try:
        response = await upstream.client().request(
            request.method,
            call.route.base_url + request.path,
            content=dumps(request.json).encode() if request.json is not None else None,
            headers={**call.route.upstream_headers, "Content-Type": "application/json"},
        )
    except httpx.HTTPError as exc:
        raise UpstreamError(f"{request.path}: {type(exc).__name__}") from exc
    if response.status_code != 200:
        raise UpstreamError(f"{request.path}: HTTP {response.status_code}: {response.text[:200]}")
    return response.json()


async def prompt_token_ids(call: Call) -> list[int]:
    """The prompt as the target tokenizes it (chat template applied by the server itself). Unsupported when the
    server kind cannot tokenize it."""
    if call.kind == "completion" and isinstance(call.body.get("prompt"), list):
        return [int(t) for t in call.body["prompt"]]
    wire = wire_for(call.route.kind)
    if call.kind == "chat":
        request = wire.tokenize(model=call.upstream_model, messages=call.body["messages"])
    else:
        request = wire.tokenize(model=call.upstream_model, prompt=call.body["prompt"])
    return wire.parse_tokenize(await _send(call, request))


async def serve(call: Call):
    route = call.route
    plan = await preflight(call)
    if isinstance(plan, str):
        return await plain(call, action=Action.SKIPPED, reason=plan)
    if plan.native:
        return await native.serve(call)
    sampling, decision = plan.sampling, plan.decision
    try:
        prompt_ids = await prompt_token_ids(call)
    except Unsupported as exc:
        return await plain(call, action=Action.SKIPPED, reason=f"cannot tokenize: {exc.reason}")
    except (UpstreamError, KeyError, ValueError) as exc:
        return await plain(call, action=Action.FELL_BACK, reason=f"tokenize failed: {exc}")
    decision = goodput.reconsider(call, decision)  # the rest of a burst may have arrived meanwhile
    if decision.plain:
        return await plain(call, action=Action.SKIPPED, reason=decision.reason)
    call.guard_reason = decision.reason
    max_context = preflight_max_context(call)
    # The length fields as the server reads them (vLLM's completions ignore max_completion_tokens, ...).
    try:
        max_tokens = semantics_for(route.kind).max_new_tokens(
            kind=call.kind, body=call.body, prompt_len=len(prompt_ids), max_context=max_context
        )
    except ValueError as exc:
        return await plain(call, action=Action.SKIPPED, reason=f"too long: {exc}")
    if max_tokens < 1:
        return await plain(
            call,
            action=Action.SKIPPED,
            reason=f"too long: the {len(prompt_ids)} prompt tokens leave no room in the context of {max_context}",
        )
    if int(call.body.get("min_tokens") or 0) > max_tokens:
        return await plain(call, action=Action.SKIPPED, reason="min_tokens > max_tokens (the server refuses it)")
    channel = GatewayChannel(call.request_id)
    job = ProdJob(
        request_id=call.request_id,
        endpoint_id=route.endpoint_id,
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        k=route.k,
        path=route.path,
        sampling=sampling.job(),
        stop={name: call.body[name] for name in STOP_FIELDS if call.body.get(name) is not None},
        node_class=route.node_class,
        workload=call.workload,  # `draft: auto`: the worker runs this workload's best candidate and K
    )
    try:
        await channel.check()
        slot = await admission.admit(
            node_class=route.node_class,
            request_id=call.request_id,
            hold_s=START_TIMEOUT_S + SLOT_SLACK_S,
            single=admission.single_stream(path=route.path, mechanism=route.mechanism),
        )
    except ChannelError as exc:
        return await plain(call, action=Action.FELL_BACK, reason=str(exc))
    if not slot.admitted:  # every worker of the node class is busy: plain at once rather than wait
        return await plain(call, action=Action.SKIPPED, reason=slot.reason(route.node_class))
    stop_job = {"node_class": route.node_class, "request_id": call.request_id}
    try:
        await asyncio.to_thread(queue.enqueue_prod, job, expires_s=START_TIMEOUT_S)
    except ChannelError as exc:
        return await plain(call, action=Action.FELL_BACK, reason=str(exc))
    except asyncio.CancelledError:  # the client went away while the job was being queued
        admission.cancel(**stop_job)
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the broker raises, the client gets a plain answer
        await admission.cancel_now(**stop_job)
        return await plain(call, action=Action.FELL_BACK, reason=f"could not enqueue: {type(exc).__name__}: {exc}")
    try:
        first = await channel.receive(START_TIMEOUT_S)
    except ChannelError as exc:
        return await plain(call, action=Action.FELL_BACK, reason=str(exc))
    except asyncio.CancelledError:  # the client went away before the worker started
        admission.cancel(**stop_job)
        raise
    if first is None:
        await admission.cancel_now(**stop_job)  # a worker that takes it late stops at once
        await channel.discard()
        return await plain(
            call,
            action=Action.FELL_BACK,
            reason=f"no worker on gpu.{route.node_class} took the request within {START_TIMEOUT_S:g} s",
        )
    if isinstance(first, Error | Cancelled):
        return await plain(call, action=Action.FELL_BACK, reason=_failure(first))
    shape = Shape(
        kind=call.kind,
        request_id=call.request_id,
        model=call.upstream_model,
        prompt_ids=prompt_ids,
        return_token_ids=bool(call.body.get("return_token_ids")),
        include_usage=bool((call.body.get("stream_options") or {}).get("include_usage")),
        # vLLM echoes the prompt text, or "" when token ids are returned (completions only; see exactness)
        echo_text=call.body["prompt"] if call.body.get("echo") and not call.body.get("return_token_ids") else "",
    )
    run = ProdRun(
        call=call, channel=channel, shape=shape, prompt_ids=prompt_ids, max_tokens=max_tokens, sampling=sampling
    )
    if call.stream:
        reply = StreamingHttpResponse(run.stream(), content_type="text/event-stream; charset=utf-8")
        reply[REQUEST_ID_HEADER] = call.request_id
        reply["Cache-Control"] = "no-cache"
        return reply
    return await run.whole()


class ProdRun:
    def __init__(
        self,
        *,
        call: Call,
        channel: GatewayChannel,
        shape: Shape,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: request_sampling.RequestSampling,
    ) -> None:
        self.call = call
        self.channel = channel
        self.shape = shape
        self.prompt_ids = prompt_ids
        self.max_tokens = max_tokens
        self.sampling = sampling
        self.ids: list[int] = []
        self.text = ""
        self.finish_reason = ""
        self.stop_reason: int | str | None = None
        self.stats: dict[str, Any] = {}
        self.failure = ""
        self.recorded = False
        self.unfinished = False  # the plain continuation failed as well: the stream ends with an error event

    async def messages(self) -> AsyncIterator[Tokens]:
        """Token messages until done; on failure sets self.failure and stops."""
        while True:
            try:
                message = await self.channel.receive(STEP_TIMEOUT_S)
            except ChannelError as exc:
                self.failure = f"{exc} after {len(self.ids)} tokens"
                return
            if message is None:
                self.failure = f"worker sent nothing for {STEP_TIMEOUT_S:g} s after {len(self.ids)} tokens"
                self.stop_worker()
                await self.channel.discard()
                return
            if isinstance(message, Tokens):
                self.ids.extend(message.ids)
                self.text += message.text
                yield message
            elif isinstance(message, Done):
                self.finish_reason = message.finish_reason
                self.stop_reason = message.stop_reason
                self.stats = message.stats
                self.text += message.text
                if message.text:
                    yield Tokens([], message.text)
                return
            elif isinstance(message, Error | Cancelled):
                self.failure = f"{_failure(message)} (after {len(self.ids)} tokens)"
                return

    def stop_worker(self) -> None:
        """Tell the worker to stop this job within one step and free its slot (never awaited: also runs while
        the request task is being cancelled)."""
        admission.cancel(node_class=self.call.route.node_class, request_id=self.call.request_id)

    def _record(self) -> None:
        """Written once, as soon as the outcome is known (before the last bytes go out)."""
        if self.recorded:
            return
        self.recorded = True
        latency_ms = self.call.elapsed_ms()
        route = self.call.route
        common = {
            "path": route.path,
            "mechanism": route.mechanism,
            "k": route.k,
            "latency_ms": latency_ms,
            "workload": self.call.workload,
        }
        if self.failure:
            goodput.end(self.call)
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
        stats = dict(self.stats)
        # the worker's reason (draft: auto's pick) and the guard's both say why this request speculated
        reason = "; ".join(r for r in (stats.pop("reason", None), self.call.guard_reason) if r)
        keep_record(
            endpoint_id=route.endpoint_id,
            request_id=self.call.request_id,
            mode=route.mode,
            action=Action.SPECULATED,
            reason=reason,
            output_tokens=len(self.ids),
            **{**common, **stats},
        )
        spawn(
            goodput.observe(self.call, kind=goodput.SPEC, tokens=len(self.ids), latency_ms=latency_ms),
            what=f"goodput sample {self.call.request_id}",
        )

    async def whole(self):
        try:
            async for _ in self.messages():
                pass
        except asyncio.CancelledError:  # the client went away (Django cancels the view on disconnect)
            self.failure = f"client went away after {len(self.ids)} tokens; the worker was told to stop"
            self.stop_worker()
            self._record()
            raise
        if self.failure:
            return await plain(self.call, action=Action.FELL_BACK, reason=self.failure)
        self._record()
        reply = HttpResponse(
            dumps(self.shape.response(self.text, self.ids, self.finish_reason, self.stop_reason)).encode(),
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
                if message.ids or message.text:
                    yield self.shape.chunk(message.text, message.ids, first=not sent_any)
                    sent_any = True
            if self.failure:
                async for piece in self._continue_plain(first_sent=sent_any):
                    yield piece
                self._record()
                if self.unfinished:
                    # neither the worker nor the server could finish: a clear error, not a "length" that
                    # looks complete (the openai client raises it)
                    yield error_event(
                        f"generation could not be finished after {len(self.ids)} tokens; retry the request",
                        code="generation_unfinished",
                    )
                    return
            else:
                self._record()
                yield self.shape.chunk(
                    "", [], finish_reason=self.finish_reason, stop_reason=self.stop_reason, first=not sent_any
                )
            yield self.shape.usage_chunk(len(self.ids))
            yield DONE
        finally:
            if not self.recorded:
                if not self.failure and not self.finish_reason:
                    self.failure = f"client went away after {len(self.ids)} tokens; the worker was told to stop"
                    self.stop_worker()
                self._record()

    def _stop_fields_left(self) -> dict[str, Any]:
        """The request's stop fields for the rest of the generation (a stop string that began in text already
        sent is not seen by the server: the continuation is a fallback, recorded as such)."""
        fields = {name: self.call.body[name] for name in STOP_FIELDS if self.call.body.get(name) is not None}
        if "min_tokens" in fields:
            fields["min_tokens"] = max(0, int(fields["min_tokens"]) - len(self.ids))
        return fields

    async def _continue_plain(self, *, first_sent: bool) -> AsyncIterator[bytes]:
        """Let the endpoint finish from the committed tokens with the request's sampling.

        Exact in distribution: the committed prefix follows the target's, and the server samples the rest from
        the same processed distribution (a seeded request loses only its reproducibility)."""
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
        wire = wire_for(self.call.route.kind)
        try:
            request = wire.continuation(
                model=self.call.upstream_model,
                token_ids=self.prompt_ids + self.ids,
                max_tokens=remaining,
                fields={**self.sampling.upstream(), **self._stop_fields_left()},
                stream=True,
            )
        except Unsupported as exc:
            self.failure += f"; no plain continuation: {exc.reason}"
            self.unfinished = True
            return
        splitter = EventSplitter()
        finish = None
        try:
            async with upstream.client().stream(
                request.method,
                self.call.route.base_url + request.path,
                content=dumps(request.json).encode(),
                headers={**self.call.route.upstream_headers, "Content-Type": "application/json"},
            ) as response:
                if response.status_code != 200:
                    self.failure += f"; plain continuation failed too: HTTP {response.status_code} from the server"
                    self.unfinished = True
                    return
                async for chunk in response.aiter_raw():
                    for raw in splitter.feed(chunk):
                        data = payload_of(raw)
                        piece = wire.parse_continuation(data) if data else None
                        if piece is None:
                            continue
                        self.ids.extend(piece.token_ids)
                        self.text += piece.text
                        finish = piece.finish_reason
                        yield self.shape.chunk(
                            piece.text,
                            piece.token_ids,
                            finish_reason=finish,
                            stop_reason=piece.stop_reason,
                            first=not first_sent,
                        )
                        first_sent = True
        except (httpx.HTTPError, WireError) as exc:
            self.failure += f"; plain continuation failed too: {type(exc).__name__}"
            self.unfinished = True
            return
        if finish is None:  # the server's stream ended without a finish reason: broken off, not complete
            self.failure += "; plain continuation broke off"
            self.unfinished = True
