"""Shadow mode: the endpoint's response goes back untouched; a sampled fraction is measured off the path.

For a sampled request the gateway asks the server for the token ids it produced (the server kind's wire
format says how: vLLM's and SGLang's `return_token_ids`) and, unless the client asked for them itself, strips
them again before relaying (null for vLLM, absent for SGLang: what each sends without the flag), re-encoding
the JSON compactly as vLLM writes it, so the bytes are those of an unsampled request. A server kind that
cannot return token ids (a generic OpenAI-compatible one) is never sampled.
The measurement task is enqueued after the last byte went out; a failure there is logged
and never reaches the client.
"""

from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from ace import json_body
from fleet.adapters import ServerWire, Unsupported, WireError, wire_for
from speculation.gateway import background, passthrough
from speculation.gateway import sampling as request_sampling
from speculation.gateway.call import Call
from speculation.gateway.sse import EventSplitter, dumps, payload_of
from speculation.jobs import queue
from speculation.jobs.job import ShadowJob

logger = logging.getLogger(__name__)


class ShadowCapture:
    """Observer that collects prompt and output token ids of choice 0 (and strips them when it added them)."""

    def __init__(self, call: Call, *, injected: bool, wire: ServerWire) -> None:
        self.call = call
        self.injected = injected
        self.wire = wire
        self.unreadable = False  # an answer's token ids could not be read: the sample is not measured
        self.prompt_ids: list[int] = []
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.splitter = EventSplitter()

    def _take(self, payload: dict[str, Any]) -> bool:
        """Collect ids from one response object; True when it carried some (and they were stripped)."""
        try:
            seen = self.wire.take_token_ids(payload, strip=self.injected)
        except WireError as exc:  # relay the bytes as they came; this sample is not measured
            logger.info("shadow sample: unreadable token ids: %s", exc)
            self.unreadable = True
            return False
        if seen.prompt_ids is not None:
            self.prompt_ids = seen.prompt_ids
        self.output_ids.extend(seen.output_ids)
        if seen.finish_reason:
            self.finish_reason = seen.finish_reason
        return seen.found and self.injected

    def on_body(self, status: int, body: bytes) -> bytes:
        if status != 200:
            return body
        try:
            payload = json_body.loads(body)  # nested too deep: TooDeep, a ValueError
        except ValueError:
            return body
        if isinstance(payload, dict) and self._take(payload):
            return dumps(payload).encode()
        return body

    def on_chunk(self, chunk: bytes) -> bytes:
        out = []
        for raw in self.splitter.feed(chunk):
            payload = payload_of(raw)
            if payload is not None and self._take(payload):
                out.append(b"data: " + dumps(payload).encode() + b"\n\n")
            else:
                out.append(raw)
        return b"".join(out)

    async def on_done(self, status: int, error: str = "") -> None:
        if status != 200 or error or self.unreadable or not self.output_ids or not self.prompt_ids:
            if status == 200 and not error:
                logger.info("request %s: shadow sample without token ids; not measured", self.call.request_id)
            return
        background.spawn(self._enqueue(latency_ms=self.call.elapsed_ms()), what="shadow enqueue")

    async def _enqueue(self, *, latency_ms: float) -> None:
        route = self.call.route
        sampling = request_sampling.parse(self.call.body)
        if isinstance(sampling, str):
            logger.info("request %s: shadow sample not measured: %s", self.call.request_id, sampling)
            return
        job = ShadowJob(
            endpoint_id=route.endpoint_id,
            request_id=self.call.request_id,
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids,
            finish_reason=self.finish_reason or "",
            max_tokens=_max_tokens(self.call.body),
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            latency_ms=latency_ms,
            workload=self.call.workload,
        )
        await asyncio.to_thread(queue.enqueue_shadow, job, node_class=route.node_class)


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(value) if isinstance(value, int) else None


async def serve(call: Call):
    route = call.route
    if route.shadow_sample_rate <= 0 or random.random() >= route.shadow_sample_rate:
        return await passthrough.forward(call)
    wire = wire_for(route.kind)
    try:
        fields = wire.token_ids_fields()
    except Unsupported as exc:
        logger.info("request %s: shadow sample not measured: %s", call.request_id, exc.reason)
        return await passthrough.forward(call)
    injected = any(call.body.get(name) != value for name, value in fields.items())
    content = call.upstream_bytes(**fields) if injected else call.upstream_bytes()
    capture = ShadowCapture(call, injected=injected, wire=wire)
    return await passthrough.forward(call, content=content, observer=capture)
