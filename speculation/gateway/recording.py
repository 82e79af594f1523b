"""An observer for requests the stage sends plain (skipped, fell back): counts tokens, writes the record."""

from __future__ import annotations

from speculation.gateway import goodput
from speculation.gateway.background import spawn
from speculation.gateway.call import Call
from speculation.gateway.sse import TokenCount
from speculation.models import Action
from speculation.services.records import keep_record


def output_tokens_of(payload: dict) -> int | None:
    usage = payload.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return usage["completion_tokens"]
    return None


class PlainRecorder:
    """Observer of a request prod sends plain: the answer is relayed untouched and its tokens counted as an off
    request's are (sse.TokenCount: no JSON parsed per event)."""

    def __init__(self, call: Call, *, action: str, reason: str, extra: dict | None = None) -> None:
        self.call = call
        self.action = action
        self.reason = reason
        self.extra = extra or {}
        self.count = TokenCount(call.kind)

    def on_body(self, status: int, body: bytes) -> bytes:
        self.count.body(body)
        return body

    def on_chunk(self, chunk: bytes) -> bytes:
        self.count.chunk(chunk)
        return chunk

    async def on_done(self, status: int, error: str = "") -> None:
        latency_ms = self.call.elapsed_ms()
        tokens = self.count.tokens()
        reason = self.reason
        if status != 200 or error:
            reason = f"{reason}; plain request failed too: {error or f'HTTP {status}'}"
        keep_record(
            endpoint_id=self.call.route.endpoint_id,
            request_id=self.call.request_id,
            mode=self.call.route.mode,
            action=self.action,
            reason=reason,
            path=self.call.route.path,
            mechanism=self.call.route.mechanism,
            workload=self.call.workload,
            output_tokens=tokens,
            tok_s=tokens / (latency_ms / 1000.0) if tokens and latency_ms > 0 else None,
            latency_ms=latency_ms,
            **self.extra,
        )
        if self.call.load_bucket:  # a prod request the goodput guard counted: a plain sample when it succeeded
            served = self.action == Action.SKIPPED and status == 200 and not error
            if served:  # spawned, as an off request's sample is: the client's stream ends without waiting for Redis
                spawn(
                    goodput.observe(self.call, kind=goodput.PLAIN, tokens=tokens, latency_ms=latency_ms, later=True),
                    what="goodput sample",
                )
            else:
                goodput.end(self.call)
