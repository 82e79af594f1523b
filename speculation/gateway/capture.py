"""Traffic capture in the gateway: a sampled fraction of an opted-in endpoint's requests is kept, with its served
output, as token ids (speculation.services.captures), to train drafts on the endpoint's own traffic.

In every mode: off and shadow traffic is what teaches a draft before prod ever runs, and prod's is what keeps it
current. A request is captured only when its endpoint opted in (Route.capture_rate > 0), it does not carry
OPT_OUT_HEADER, and the sample draw falls under the rate. For a captured request the gateway asks the server (or
prod's own response) for token ids as shadow does (the server kind's wire format says how; a kind that cannot
return them is never captured) and strips them again unless the client asked for them itself, so the client reads
the answer an uncaptured request gets (in prod, a stripped field reads null, as vLLM sends it without the flag).
The ids are read from the bytes as they go out; a complete answer (a finish reason, both prompt and output ids)
is queued for writing after its last byte, never delaying it; a failed or broken-off one is not kept.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable

from django.http import HttpResponseBase

from fleet.adapters import ServerWire, Unsupported, wire_for
from speculation.gateway import sampling as request_sampling
from speculation.gateway.call import Call
from speculation.gateway.shadow import ShadowCapture
from speculation.services.captures import keep_capture
from speculation.workloads import keys as workload_keys

logger = logging.getLogger(__name__)

OPT_OUT_HEADER = "X-ACE-No-Capture"
_rng = random.Random()


def opted_out(value: str | None) -> bool:
    """The header, sent with any value but 0, false or no (or empty), keeps the request out of capture."""
    return value is not None and value.strip().lower() not in ("", "0", "false", "no")


def chosen(rate: float, *, opt_out: bool, draw: Callable[[], float] = _rng.random) -> bool:
    return not opt_out and rate > 0 and draw() < rate


async def around(
    call: Call,
    serve: Callable[[Call], Awaitable[HttpResponseBase]],
    *,
    opt_out: bool,
    workload_header: str | None,
) -> HttpResponseBase:
    """Serve the call (`serve`: its mode's path), capturing it when chosen."""
    if not chosen(call.route.capture_rate, opt_out=opt_out):
        return await serve(call)
    wire = wire_for(call.route.kind)
    try:
        fields = wire.token_ids_fields()
    except Unsupported as exc:
        logger.debug("request %s not captured: %s", call.request_id, exc.reason)
        return await serve(call)
    injected = any(call.body.get(name) != value for name, value in fields.items())
    if injected:  # every path reads the body from here: off's relay, shadow's, prod's own answer and its fallbacks
        call.body = {**call.body, **fields}
        call.raw = json.dumps(call.body).encode()
    tap = CaptureTap(call, injected=injected, wire=wire, workload=_workload(call, workload_header))
    return tap.watch(await serve(call))


def _workload(call: Call, header: str | None) -> str:
    """The request's workload key (off mode resolves none for its records: resolved here, for captures only)."""
    if call.workload:
        return call.workload
    try:
        return workload_keys.resolve(header=header, body=call.body, kind=call.kind).key
    except workload_keys.BadWorkload:
        return workload_keys.UNKNOWN


class CaptureTap(ShadowCapture):
    """Reads choice 0's token ids from the response as it goes out (shadow's reader) and keeps a complete one."""

    def __init__(self, call: Call, *, injected: bool, wire: ServerWire, workload: str) -> None:
        super().__init__(call, injected=injected, wire=wire)
        self.workload = workload

    def watch(self, response: HttpResponseBase) -> HttpResponseBase:
        if response.status_code != 200:
            return response
        if response.streaming:
            response.streaming_content = self._relay(response.streaming_content)
        else:
            response.content = self.on_body(200, response.content)
            self.done(complete=True)
        return response

    async def _relay(self, parts: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        complete = False
        try:
            async with contextlib.aclosing(parts) as stream:
                async for part in stream:
                    yield self.on_chunk(part)
            complete = True
        finally:
            self.done(complete=complete)

    def done(self, *, complete: bool) -> None:
        if not complete or self.unreadable or not self.finish_reason or not self.prompt_ids or not self.output_ids:
            return
        keep_capture(
            endpoint_id=self.call.route.endpoint_id,
            workload=self.workload,
            mode=self.call.route.mode,
            prompt_ids=self.prompt_ids,
            output_ids=self.output_ids,
            greedy=_greedy(self.call.body),
        )


def _greedy(body: dict) -> bool:
    sampling = request_sampling.parse(body)
    return not isinstance(sampling, str) and sampling.greedy
