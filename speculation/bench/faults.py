"""The fault run's load and report (manage.py fault_run): concurrent greedy prod streams, each classified.

Every request is one of:
    correct      the stream ended with [DONE] and its text equals the off-mode answer to the same prompt
    wrong_text   the stream ended with [DONE] but its text differs (a silent error: the worst outcome)
    clear_error  an HTTP error with an OpenAI-shaped JSON body, or an error event in the stream
    truncated    the stream stopped without [DONE] and without an error event (the client cannot tell)
    unclear_error an HTTP error whose body is not an OpenAI-shaped error
    hang         no byte for longer than the hang limit (the step timeout plus a grace)
    unreachable  ACE itself did not answer (it is never killed in the run, so this is a failure too)
The run passes when wrong_text, truncated, unclear_error, hang and unreachable are all 0 and every completed
request has its stage record. Pure logic here (classify, summarize); the processes live in the command.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from speculation.gateway.errors import REQUEST_ID_HEADER

OUTCOMES = ("correct", "wrong_text", "clear_error", "truncated", "unclear_error", "hang", "unreachable")
BAD = ("wrong_text", "truncated", "unclear_error", "hang", "unreachable")
EXAMPLES_PER_KIND = 5


@dataclass
class Outcome:
    lane: int
    prompt: int
    started_s: float  # since the load began
    elapsed_s: float = 0.0
    status: int = 0
    request_id: str = ""
    text: str = ""
    done: bool = False  # [DONE] seen
    finish_reason: str = ""
    error: str = ""  # the error the client was given (message), or what broke
    error_event: bool = False
    max_gap_s: float = 0.0
    timed_out: bool = False
    unreachable: bool = False
    kind: str = ""
    phase: str = ""


def chat_body(model: str, prompt: str, max_tokens: int) -> dict:
    """A greedy streamed chat request (prod serves it on the speculative path)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def classify(outcome: Outcome, expected: str) -> str:
    if outcome.unreachable or (outcome.status == 0 and not outcome.timed_out):
        return "unreachable"  # no HTTP answer at all (refused, or the connection broke before the headers)
    if outcome.timed_out:
        return "hang"
    if outcome.status != 200:
        return "clear_error" if outcome.error else "unclear_error"
    if outcome.error_event:
        return "clear_error"
    if not outcome.done:
        return "truncated"
    return "correct" if outcome.text == expected else "wrong_text"


def _error_message(body: bytes) -> str:
    try:
        payload = json.loads(body)
    except ValueError:
        return ""
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return ""


async def one_request(
    client: httpx.AsyncClient, url: str, *, body: dict, headers: dict, hang_s: float, outcome: Outcome
) -> Outcome:
    """One streaming chat request; fills `outcome` (never raises)."""
    started = last = time.monotonic()
    response = None
    try:
        request = client.build_request("POST", url, json=body, headers=headers)
        response = await asyncio.wait_for(client.send(request, stream=True), hang_s)
        outcome.max_gap_s = time.monotonic() - started
        last = time.monotonic()
        outcome.status = response.status_code
        outcome.request_id = response.headers.get(REQUEST_ID_HEADER, "")
        if response.status_code != 200:
            outcome.error = _error_message(await asyncio.wait_for(response.aread(), hang_s))
            return outcome
        lines = response.aiter_lines()
        while True:
            try:
                line = await asyncio.wait_for(anext(lines), hang_s)
            except StopAsyncIteration:
                break
            now = time.monotonic()
            outcome.max_gap_s = max(outcome.max_gap_s, now - last)
            last = now
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                outcome.done = True
                continue
            payload = json.loads(data)
            if "error" in payload:
                outcome.error_event = True
                outcome.error = str((payload.get("error") or {}).get("message", payload["error"]))
                continue
            for choice in payload.get("choices") or []:
                outcome.text += (choice.get("delta") or {}).get("content") or ""
                outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
    except TimeoutError:
        outcome.timed_out = True
        outcome.error = f"no byte for {hang_s:g} s"
    except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
        outcome.unreachable = True
        outcome.error = type(exc).__name__
    except (httpx.HTTPError, ValueError) as exc:  # the stream broke off (or a line was not JSON)
        outcome.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        outcome.elapsed_s = time.monotonic() - started
        if response is not None:
            await response.aclose()
    return outcome


@dataclass
class Load:
    """`lanes` concurrent streams, each sending its next request as soon as the last one ended, until stopped."""

    url: str
    model: str
    prompts: list[str]
    headers: dict[str, str]
    lanes: int = 32
    max_tokens: int = 32
    hang_s: float = 45.0
    pause_after_error_s: float = 0.5
    stop: threading.Event = field(default_factory=threading.Event)
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=self.lanes + 4, max_keepalive_connections=self.lanes + 4)
        timeout = httpx.Timeout(connect=5.0, read=self.hang_s + 5.0, write=10.0, pool=10.0)
        began = time.monotonic()
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

            async def lane(index: int) -> None:
                n = 0
                while not self.stop.is_set():
                    prompt = (index + n) % len(self.prompts)
                    n += 1
                    outcome = Outcome(lane=index, prompt=prompt, started_s=round(time.monotonic() - began, 3))
                    body = chat_body(self.model, self.prompts[prompt], self.max_tokens)
                    await one_request(
                        client, self.url, body=body, headers=self.headers, hang_s=self.hang_s, outcome=outcome
                    )
                    self.outcomes.append(outcome)
                    if outcome.status != 200 or outcome.error:
                        await asyncio.sleep(self.pause_after_error_s)

            await asyncio.gather(*(lane(i) for i in range(self.lanes)))


def phase_at(t: float, events: list[tuple[float, str]]) -> str:
    """The last fault event at or before t ("steady" before the first)."""
    current = "steady"
    for at, name in events:
        if at <= t:
            current = name
    return current


def summarize(
    outcomes: list[Outcome],
    *,
    expected: dict[int, str],
    records: dict[str, dict],
    events: list[tuple[float, str]],
    reason_class=None,
) -> dict:
    """Counts for the JSON: outcomes overall and per phase, records by action, completed requests without a
    record, the slowest error, the largest gap between bytes, and the verdict."""
    by_outcome: Counter[str] = Counter()
    by_phase: dict[str, Counter[str]] = {}
    lost, errors, wrong = [], Counter(), []
    slowest_error = 0.0
    for outcome in outcomes:
        outcome.kind = classify(outcome, expected[outcome.prompt])
        outcome.phase = phase_at(outcome.started_s, events)
        by_outcome[outcome.kind] += 1
        by_phase.setdefault(outcome.phase, Counter())[outcome.kind] += 1
        if outcome.kind == "clear_error":
            errors[f"HTTP {outcome.status}: {outcome.error[:80]}"] += 1
            slowest_error = max(slowest_error, outcome.elapsed_s)
        if outcome.kind in ("correct", "wrong_text") and outcome.request_id not in records:
            lost.append(outcome.request_id)
        if outcome.kind in BAD and sum(1 for w in wrong if w["kind"] == outcome.kind) < EXAMPLES_PER_KIND:
            wrong.append(asdict(outcome))
    record_actions = Counter(r["action"] for r in records.values())
    reasons = Counter(
        (reason_class(r["action"], r.get("reason", "")) if reason_class else r.get("reason", "")[:60])
        for r in records.values()
        if r["action"] == "fell_back"
    )
    bad = sum(by_outcome[k] for k in BAD)
    return {
        "requests": len(outcomes),
        "outcomes": {k: by_outcome[k] for k in OUTCOMES},
        "by_phase": {phase: dict(counts) for phase, counts in by_phase.items()},
        "completed_without_record": len(lost),
        "completed_without_record_ids": lost[:20],
        "records": len(records),
        "records_by_action": dict(record_actions),
        "fallback_reasons": dict(reasons),
        "clear_errors": dict(errors.most_common(12)),
        "slowest_clear_error_s": round(slowest_error, 2),
        "max_gap_between_bytes_s": round(max((o.max_gap_s for o in outcomes), default=0.0), 2),
        "bad_examples": wrong,
        "passed": bad == 0 and not lost,
    }
