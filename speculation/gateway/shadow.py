"""Shadow mode: the endpoint's response goes back untouched; a sampled fraction is measured off the path.

For a sampled request the gateway asks the server for the token ids it produced (`return_token_ids`) and,
unless the client asked for them itself, sets them back to null (what vLLM sends without the flag) before
relaying, re-encoding the JSON compactly as vLLM writes it, so the bytes are those of an unsampled request.
The measurement task is enqueued after the last byte went out; a failure there is logged
and never reaches the client.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from typing import Any

from speculation.gateway import background, passthrough
from speculation.gateway import sampling as request_sampling
from speculation.gateway.call import Call
from speculation.gateway.sse import EventSplitter, dumps, payload_of

logger = logging.getLogger(__name__)

_IDS = ("token_ids", "prompt_token_ids")


class ShadowCapture:
    """Observer that collects prompt and output token ids of choice 0 (and strips them when it added them)."""

    def __init__(self, call: Call, *, injected: bool) -> None:
        self.call = call
        self.injected = injected
        self.prompt_ids: list[int] = []
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self.splitter = EventSplitter()

    def _take(self, payload: dict[str, Any]) -> bool:
        """Collect ids from one response object; True when it carried some (and they were stripped)."""
        found = False
        if payload.get("prompt_token_ids") is not None:
            self.prompt_ids = list(payload["prompt_token_ids"])
            found = True
            if self.injected:
                payload["prompt_token_ids"] = None
        for choice in payload.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            if choice.get("prompt_token_ids") is not None:
                self.prompt_ids = list(choice["prompt_token_ids"])
            if choice.get("token_ids") is not None:
                self.output_ids.extend(choice["token_ids"])
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            if self.injected:
                for key in _IDS:
                    if choice.get(key) is not None:
                        found = True
                        choice[key] = None
            else:
                found = found or any(key in choice for key in _IDS)
        return found and self.injected

    def on_body(self, status: int, body: bytes) -> bytes:
        if status != 200:
            return body
        try:
            payload = json.loads(body)
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
        if status != 200 or error or not self.output_ids or not self.prompt_ids:
            if status == 200 and not error:
                logger.info("request %s: shadow sample without token ids; not measured", self.call.request_id)
            return
        background.spawn(self._enqueue(latency_ms=self.call.elapsed_ms()), what="shadow enqueue")

    async def _enqueue(self, *, latency_ms: float) -> None:
        from speculation.worker.tasks import enqueue_shadow

        route = self.call.route
        sampling = request_sampling.parse(self.call.body)
        if isinstance(sampling, str):
            logger.info("request %s: shadow sample not measured: %s", self.call.request_id, sampling)
            return
        await asyncio.to_thread(
            enqueue_shadow,
            endpoint_id=route.endpoint_id,
            node_class=route.node_class,
            request_id=self.call.request_id,
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids,
            finish_reason=self.finish_reason or "",
            max_tokens=_max_tokens(self.call.body),
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            latency_ms=latency_ms,
        )


def _max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens") or body.get("max_tokens")
    return int(value) if isinstance(value, int) else None


async def serve(call: Call):
    route = call.route
    if route.shadow_sample_rate <= 0 or random.random() >= route.shadow_sample_rate:
        return await passthrough.forward(call)
    injected = not call.body.get("return_token_ids")
    content = call.upstream_bytes(return_token_ids=True) if injected else call.upstream_bytes()
    return await passthrough.forward(call, content=content, observer=ShadowCapture(call, injected=injected))
