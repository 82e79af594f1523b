"""Timing the local path as prod runs it when the worker batches (speculation.worker.batching). The calibration
times a BatchDecoder's own steps (``BatchStepTimer``, below). The row adapters time one row of the
batch engine's BatchedModel, the same forward the BatchDecoder runs for a lone request (padding-free row 0, its own
cache, the attention mask of the batch), not the batch-1 Transformer with its static cache. At batch size 1 the two
differ by a fixed cost per forward (measured: a lone request in the batch ran at 23 tok/s where the single-stream
loop ran at 29), which a projection timed on the wrong one carries into every K.

``BatchRowTarget`` is the engine's Target protocol and ``BatchRowDraft`` its Proposer protocol over one row, for
speculation.engine.costs.time_verify / time_draft_step only (the shadow_costs benchmark compares them with the
batch-1 engine): greedy drafts, no sampling.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from speculation.engine.batch_model import BatchedModel
from speculation.engine.lookahead import StepReport
from speculation.engine.model import Transformer
from speculation.engine.proposers import Proposal
from speculation.engine.sampling import SamplingParams
from speculation.engine.target import TargetOutput

logger = logging.getLogger(__name__)


class BatchRowTarget:
    """A target verifying on row 0 of a BatchedModel, as BatchDecoder._verify does for one slot."""

    def __init__(self, model: Transformer) -> None:
        self.rows = BatchedModel(model, max_rows=1)
        self.device = self.rows.device
        self.vocab_size = model.vocab_size
        self.max_context = self.rows.max_len
        self.length = 0

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> None:
        self.length = 0
        if len(prompt_ids) > 1:
            self.rows.reserve(1, len(prompt_ids))
            self.rows.forward(torch.tensor(prompt_ids[:-1], device=self.device)[None], [0])
            self.length = len(prompt_ids) - 1

    @torch.inference_mode()
    def forward(self, tokens: Tensor, *, return_hidden: bool = False) -> TargetOutput:
        t = int(tokens.shape[0])
        self.rows.reserve(1, self.length + t)
        logits = self.rows.forward(tokens[None], [self.length])[0]  # [T, V]
        self.length += t
        return TargetOutput(logits=logits, hidden=None)

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot roll back to {length}: {self.length} positions are cached")
        self.length = length


class BatchRowDraft:
    """A draft model proposing on row 0 of a BatchedModel, as BatchDecoder._draft_model_proposals does for one
    slot: one forward feeding the committed tokens the row has not seen, then one per further draft token."""

    wants_hidden = False

    def __init__(self, model: Transformer) -> None:
        self.rows = BatchedModel(model, max_rows=1)
        self.device = self.rows.device
        self.length = 0  # committed tokens the row holds

    def begin(self, prompt_ids: list[int]) -> None:
        self.length = 0

    @torch.inference_mode()
    def propose(
        self, committed: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        self.rows.reserve(1, len(committed) + k)
        feed = torch.tensor(committed[self.length :], device=self.device)[None]  # [1, unseen]
        logits = self.rows.forward(feed, [self.length], last=[feed.shape[1] - 1])  # [1, V]
        position, tokens = len(committed), []
        for j in range(k):
            token = logits.argmax(-1)  # [1]
            tokens.append(token)
            if j + 1 < k:  # the last draft token is never fed
                logits = self.rows.forward(token[:, None], [position], last=[0])
                position += 1
        self.length = len(committed)  # the drafts fed are rewritten next time (nothing accepted is assumed)
        return Proposal(tokens=torch.cat(tokens) if tokens else torch.empty(0, dtype=torch.long), q=None)

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        pass

    def observe_target(self, hidden: Tensor, num_accepted: int) -> None:
        pass


class _ToldK:
    """Stands in for BatchDecoder's LoadAwareLookahead: the decoder drafts the K it is told and the step's own
    timings (the draft and the verification as the decoder times them for its controller) are kept."""

    def __init__(self) -> None:
        self.k = 0
        self.last: tuple[int, float, float, bool] | None = None  # drafted, draft_s, verify_s, catch_up

    def choose(self, batch_size: int = 1, **_) -> int:
        return self.k

    def observe(self, report: StepReport) -> None:
        self.last = (report.drafted, report.draft_s, report.verify_s, report.catch_up)


class BatchStepTimer:
    """Prod's batched local path timed as it runs: steps of a BatchDecoder with one slot, at the K it is told, each
    timed by the decoder itself (speculation.engine.batch times the draft and the verification for its controller;
    those are the costs the lookahead controller then decides on). A step at K = n - 1 times verify(n) with the
    decoder's own work around the forward (building the rows, the acceptance rule, the one device read), which the
    row adapters above leave out: measured on the demo pair at 2 threads, the decoder's verify(6) took 6.7 ms where
    the row's forward took 4.6 ms, and its draft step 0.96 where the row's took 0.71 (docs/BENCHMARKS.md).

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
        from speculation.engine import GenerationConfig
        from speculation.engine.batch import BatchDecoder
        from speculation.limits import K_MAX

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
        from speculation.jobs.channel import WorkerChannel
        from speculation.worker.paths.stopping import StopMatcher, StopRule
        from speculation.worker.paths.text import IncrementalText
        from speculation.worker.stream import TokenStream

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
