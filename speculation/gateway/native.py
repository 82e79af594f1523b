"""Native path: the server speculates itself. ACE passes the request through and records the acceptance the
server reports: per-request `metrics.speculative_decoding` where vLLM gives it, else the deltas of vLLM's
spec-decode counters in /metrics over the request's lifetime (which include any concurrent request's
drafts: exact for one request at a time, a share of the server's acceptance under concurrency)."""

from __future__ import annotations

import logging

import httpx

from ace import json_body
from fleet.adapters import Unsupported, wire_for
from fleet.adapters.wire import REQUESTS_RUNNING
from fleet.managed.baseline import pick
from speculation.gateway import background, passthrough, upstream
from speculation.gateway.call import Call
from speculation.gateway.recording import output_tokens_of
from speculation.gateway.sse import EventSplitter, payload_of
from speculation.models import Action
from speculation.services.records import keep_record

logger = logging.getLogger(__name__)


def no_counters_reason(call: Call) -> str:
    try:
        wire_for(call.route.kind).spec_counters()
    except Unsupported as exc:
        return f"the server reported no acceptance ({exc.reason})"
    return "the server reported no acceptance (no /metrics)"


async def scrape(call: Call) -> dict[str, float] | None:
    """The server's speculation counters (and the requests it runs), as its wire format reads them."""
    wire = wire_for(call.route.kind)
    try:
        request = wire.spec_counters()
    except Unsupported:
        return None
    try:
        response = await upstream.client().request(
            request.method, call.route.base_url + request.path, headers=call.route.upstream_headers
        )
    except httpx.HTTPError as exc:
        logger.warning("request %s: %s unreachable: %s", call.request_id, request.path, exc)
        return None
    if response.status_code != 200:
        return None
    return wire.parse_spec_counters(response.text)


class NativeRecorder:
    def __init__(self, call: Call, before: dict[str, float] | None) -> None:
        self.call = call
        self.before = before
        self.output_tokens: int | None = None
        self.wire = wire_for(call.route.kind)
        self.request_stats: dict | None = None
        self.splitter = EventSplitter()

    def _take(self, payload: dict) -> None:
        tokens = output_tokens_of(payload)
        if tokens is not None:
            self.output_tokens = tokens
        stats = self.wire.response_spec_stats(payload)
        if stats is not None:
            self.request_stats = stats

    def on_body(self, status: int, body: bytes) -> bytes:
        try:
            payload = json_body.loads(body)  # nested too deep: TooDeep, a ValueError
        except ValueError:
            return body
        if isinstance(payload, dict):
            self._take(payload)
        return body

    def on_chunk(self, chunk: bytes) -> bytes:
        for raw in self.splitter.feed(chunk):
            payload = payload_of(raw)
            if payload is not None:
                self._take(payload)
        return chunk

    async def on_done(self, status: int, error: str = "") -> None:
        # Spawned: the counters are read after the response, even if the client has already gone.
        background.spawn(self._finish(status, error, self.call.elapsed_ms()), what="native record")

    async def _finish(self, status: int, error: str, latency_ms: float) -> None:
        route = self.call.route
        common = {
            "path": route.path,
            "mechanism": route.mechanism,
            "latency_ms": latency_ms,
            "output_tokens": self.output_tokens or 0,
            "workload": self.call.workload,
        }
        if status != 200 or error:
            keep_record(
                endpoint_id=route.endpoint_id,
                request_id=self.call.request_id,
                mode=route.mode,
                action=Action.FELL_BACK,
                reason=error or f"HTTP {status} from the server",
                **common,
            )
            return
        if self.request_stats is not None:
            stats, source = self.request_stats, "per-request metrics"
        else:
            after = await scrape(self.call)
            if self.before is None or after is None:
                keep_record(
                    endpoint_id=route.endpoint_id,
                    request_id=self.call.request_id,
                    mode=route.mode,
                    action=Action.SPECULATED,
                    reason=no_counters_reason(self.call),
                    **common,
                )
                return
            stats, source = self.wire.spec_stats(self.before, after), "/metrics counter deltas"
        tokens = self.output_tokens or 0
        tok_s = tokens / (latency_ms / 1000.0) if tokens and latency_ms > 0 else None
        reason = f"native; acceptance from {source}"
        measured: dict = {}
        # Managed endpoints: the same server without speculation, at the load this request started under.
        load = int((self.before or {}).get(REQUESTS_RUNNING, 0)) + 1
        chosen = pick(route.native_baseline, load) if route.native_baseline else None
        if chosen is not None and tok_s:
            bucket, baseline = chosen
            measured = {"baseline_tok_s": baseline, "multiplier": tok_s / baseline}
            reason += f"; baseline at {bucket} concurrent stream(s) (load {load})"
        keep_record(
            endpoint_id=route.endpoint_id,
            request_id=self.call.request_id,
            mode=route.mode,
            action=Action.SPECULATED,
            reason=reason,
            tok_s=tok_s,
            **{**stats, **common, **measured, "k": stats.get("k") or route.capabilities.get("native_speculation_k")},
        )


async def serve(call: Call):
    before = await scrape(call)
    if await passthrough.follow_move(call):  # the endpoint moved while its counters were read: the new one's
        before = await scrape(call)
    return await passthrough.forward(call, observer=NativeRecorder(call, before))
