"""Timing prod's local step as it runs, for the cost calibration (speculation.worker.costs): steps of the engine's
own step (speculation.engine.batch.BatchDecoder) at the K they are told, each timed by the decoder itself (its draft
and its verification, as it reports them to a lookahead controller), with the request thread's part of each step
(``StepRelay``: the stop matcher a token at a time, one send to the gateway) beside it as in prod.

- ``BatchStepTimer``: the batched path (a draft model, a lookup, the hybrid: speculation.worker.batching). The batch
  loop hands each step's tokens to the request's thread, which relays them while the loop runs the next step.
- ``SingleStepTimer``: a proposer the batch loop does not serve (an EAGLE head, a model transformers runs): prod runs
  it in the request's thread, which relays each step's tokens before the next step, so the relay is in the step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from speculation.engine.batch import BatchDecoder
from speculation.engine.lookahead import StepReport
from speculation.engine.model import Transformer
from speculation.engine.request import GenerationConfig
from speculation.engine.target import Target
from speculation.jobs.channel import WorkerChannel
from speculation.limits import K_MAX
from speculation.worker.paths.stopping import StopMatcher, StopRule
from speculation.worker.paths.text import IncrementalText
from speculation.worker.stream import TokenStream

logger = logging.getLogger(__name__)

STEPS_PER_SIZE = 3  # single-stream steps run at each K per round; the first (after the prompt's prefill) is not kept
RELAY_WAIT_S = 5.0  # a relay that hangs (Redis gone) does not hold the calibration
RELAY_POLL_S = 0.0001


class _ToldK:
    """A lookahead controller that is told K: the decoder drafts it, and the step's own timings (the draft and the
    verification, as the decoder times them for its controller) are kept."""

    def __init__(self) -> None:
        self.k = 0
        self.last: tuple[int, float, float, bool] | None = None  # drafted, draft_s, verify_s, catch_up

    def choose(self, batch_size: int = 1, **_) -> int:
        return self.k

    def observe(self, report: StepReport) -> None:
        self.last = (report.drafted, report.draft_s, report.verify_s, report.catch_up)


class BatchStepTimer:
    """Prod's batched local path timed as it runs: steps of a BatchDecoder with one slot, at the K it is told. A step
    at K = n - 1 times verify(n) with the decoder's own work around the forward (building the rows, the acceptance
    rule, the one device read), which a timing of the forwards alone leaves out.

    The slot continues the context greedily, so the drafts are the draft model's real proposals; ``round`` runs
    one step per size, a plain step last (the drafting step after plain steps also feeds the draft the tokens they
    committed: that step's draft time is not kept). A fresh decoder's first round is a warm-up: each shape's
    first CPU forward builds its kernels.

    relay: called with each step's committed tokens (``StepRelay.put``), so that the request thread's work a prod
    step sets off runs beside the next step, as in prod."""

    def __init__(
        self,
        target: Transformer,
        *,
        draft: Transformer,
        context: list[int],
        relay: Callable[[list[int]], None] | None = None,
        shared_vocab: int | None = None,
    ) -> None:
        self._told = _ToldK()
        self._decoder = BatchDecoder(  # shared_vocab: a draft padded to another size (speculation.engine.vocab)
            target,
            slots=1,
            draft=draft,
            lookahead=self._told,  # type: ignore[arg-type]
            shared_vocab=shared_vocab,
        )
        room = self._decoder.max_context - len(context) - 1
        if room < 2 * K_MAX:
            raise ValueError(f"a context of {len(context)} tokens leaves no room to time steps")
        self._decoder.add("calibration", list(context), GenerationConfig(max_new_tokens=room, k=K_MAX))
        self.warmed = False
        self._relay = relay

    def round(self, sizes: tuple[int, ...]) -> tuple[dict[int, float], list[float]]:
        """One step per size n (K = n - 1), drafting sizes first, largest first: ({n: verify seconds}, [seconds per
        drafted token]); a size the decoder could not run in full (the slot's room ran out) is left out."""
        if not self.warmed:
            self.warmed = True
            self.round(sizes)
        verify: dict[int, float] = {}
        drafts: list[float] = []
        for n in sorted(sizes, key=lambda size: (size == 1, -size)):
            if not len(self._decoder):
                break
            self._told.k = n - 1
            updates = self._decoder.step()
            if self._relay is not None:
                for update in updates:
                    self._relay(list(update.tokens))
            if self._told.last is None:
                continue
            drafted, draft_s, verify_s, catch_up = self._told.last
            self._told.last = None
            if drafted + 1 != n:
                continue
            verify[n] = verify_s
            if drafted and not catch_up:
                drafts.append(draft_s / drafted)
        return verify, drafts


class SingleStepTimer:
    """Steps of prod's single-stream path, timed as they run: ``round`` runs STEPS_PER_SIZE steps of a fresh request
    at each size n (K = n - 1, largest first) and returns ({n: [seconds of the step besides drafting]}, [seconds
    per drafted token]), a step running from the end of the previous step's relay to the end of its own (prod's
    proposer: an EAGLE head fed the target's real features, its catch-up on the accepted tokens included).
    relay: called with each step's committed tokens, returning when they are relayed."""

    def __init__(
        self,
        target: Target,
        proposer: Any,
        *,
        context: list[int],
        relay: Callable[[list[int]], None] | None = None,
    ) -> None:
        self._told = _ToldK()
        self._decoder = BatchDecoder(target, slots=1, proposer=proposer, lookahead=self._told)  # type: ignore[arg-type]
        self._context = list(context)
        self._room = target.max_context - len(context) - 1
        self._relay = relay
        self.warmed = False

    def round(self, sizes: tuple[int, ...]) -> tuple[dict[int, list[float]], list[float]]:
        if not self.warmed:  # each shape's first CPU forward builds its kernels
            self.warmed = True
            self.round(sizes)
        verify: dict[int, list[float]] = {}
        drafts: list[float] = []
        for n in sorted(sizes, reverse=True):
            for drafted, draft_s, step_s in self._steps(n - 1):
                if drafted != n - 1:  # the draft stopped short (its room): not a step of this size
                    continue
                verify.setdefault(n, []).append(step_s - draft_s)
                if drafted:
                    drafts.append(draft_s / drafted)
        return verify, drafts

    def _steps(self, k: int) -> list[tuple[int, float, float]]:
        """(drafted, draft seconds, step seconds) of a fresh request's steps after the first."""
        self._told.k = k
        self._decoder.add("calibration", self._context, GenerationConfig(max_new_tokens=self._room, k=K_MAX))
        steps: list[tuple[int, float, float]] = []
        ended = 0.0
        while len(steps) < STEPS_PER_SIZE - 1 and len(self._decoder):
            (update,) = self._decoder.step()
            if self._relay is not None:
                self._relay(list(update.tokens))
            now = time.perf_counter()
            drafted, draft_s, _, _ = self._told.last or (0, 0.0, 0.0, False)
            if ended:
                steps.append((drafted, draft_s, now - ended))
            ended, self._told.last = now, None
        self._decoder.remove("calibration")
        return steps


class StepRelay:
    """A prod request thread's part of each step, played beside a calibration's steps: in prod the batch loop hands
    each step's tokens to the request's thread, which runs them through the stop matcher (the incremental
    detokenizer) and sends them to the gateway in one Redis round trip (speculation.worker.stream.TokenStream)
    while the loop runs the next step. That thread takes the worker process's GIL between the loop's torch calls:
    on the demo pair at one thread the draft step takes 25-45 % longer per token with the relay beside it and
    verify(n) 1-17 % longer, so a calibration without it projects prod's worker step too fast.

    It runs prod's own TokenStream (the stop matcher a token at a time, then one send per step) on a key of its own
    that expires (speculation.jobs.channel.EXPIRE_S) and nobody reads; without Redis (client None, or it fails) the
    relay still runs the matcher."""

    def __init__(self, tokenizer: Any, *, client: Any = None) -> None:
        # prod's own per-step work (TokenStream: the matcher a token at a time, then one send), on a throwaway key
        channel = WorkerChannel(client, f"calibration-{uuid.uuid4().hex}") if client is not None else None
        self._stream = TokenStream(channel, slot=None)  # type: ignore[arg-type]
        # the calibration's slot runs past end tokens (its room, not the text, ends it): the matcher must not stop
        rule = StopRule.from_fields({"ignore_eos": True}, max_tokens=1 << 30, eos_token_id=None)
        self._stream.matcher = StopMatcher(rule, decode=IncrementalText(tokenizer).add)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.relayed = 0  # steps relayed
        self._thread = threading.Thread(target=self._run, name="ace-calibration-relay", daemon=True)
        self._thread.start()

    def put(self, ids: list[int]) -> None:
        self._inbox.put(ids)

    def close(self, timeout_s: float = 5.0) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        stream = self._stream
        while (ids := self._inbox.get()) is not None:
            try:
                for token in ids:
                    stream.ends_after(token)
            except Exception as exc:  # noqa: BLE001 - a token the tokenizer cannot decode: relay the ids alone
                logger.info("calibration relay: the matcher failed (%s): ids only", exc)
            if stream.channel is not None:
                try:
                    stream.send(ids)
                except Exception as exc:  # noqa: BLE001 - the timing goes on without the round trip
                    logger.info("calibration relay without Redis: %s", exc)
                    stream.channel = None
            self.relayed += 1


def waited(relay: Any) -> Callable[[list[int]], None]:
    """A StepRelay made inline: each step's tokens handed to it and waited for, as
    prod's request thread relays them itself before its next step."""

    def relay_now(ids: list[int]) -> None:
        done, deadline = relay.relayed + 1, time.monotonic() + RELAY_WAIT_S
        relay.put(ids)
        while relay.relayed < done and time.monotonic() < deadline:
            time.sleep(RELAY_POLL_S)

    return relay_now
