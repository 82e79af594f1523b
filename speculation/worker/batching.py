"""Continuous batching in the GPU worker: one batch loop per worker process serves its local-path prod requests
together (speculation.engine.batch), instead of one engine loop per Celery task.

- The Celery task of a local-path prod job hands the job to a request thread of its process and returns, so the
  process takes the next job at once (``hand_off``). The request thread runs the usual
  ``run_prod_generation`` (loading, calibration, stop rules, the Redis channel: unchanged), whose ``speculate``
  step is ``speculate`` below: it submits the request to the batch loop and relays the loop's per-step updates
  to ``emit`` (Redis round trips stay in the request thread; a Cancelled raised there takes the slot out).
- The batch loop (one daemon thread) keeps one BatchDecoder per (target, draft) pair, takes joins and leaves
  between steps, and steps every decoder with active slots. A failure in a step fails that decoder's requests
  (each falls back, with the reason) and drops the decoder; the loop goes on.
- Admission control counts batch slots: a worker declares processes x ACE_BATCH_SLOTS (``capacity``).
- Single-stream engine work (shadow replay, the remote path, a proposer the batch does not serve) uses the
  models' own KV caches: in a batching process it runs under ``single_stream()``, one at a time, as before.

Settings: ACE_BATCH_SLOTS (slots per worker process; 0 turns batching off: one loop per task, as before),
ACE_PREFIX_CACHE_MB (each decoder's prefix cache: finished requests' KV rows, reused by a request that starts with
the same tokens; 0 = off) and ACE_BATCH_LOAD_AWARE_K (greedy slots draft the K that pays at the current batch
size, K = 0 included).
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from speculation.engine import GenerationConfig
from speculation.engine.batch import BatchDecoder, SlotUpdate
from speculation.engine.lookahead import LoadAwareLookahead
from speculation.engine.prefix_cache import PrefixCache
from speculation.engine.proposers import LookupProposer, batch_form
from speculation.models import VerificationPath
from speculation.worker.paths import CommittedBatch

logger = logging.getLogger(__name__)

IDLE_DROP_S = 300.0  # an unused decoder (and its caches) is dropped after this long


class BatchFailed(RuntimeError):
    """The batch loop could not serve the request (the gateway falls back; the message is the reason)."""


def slots() -> int:
    return int(getattr(settings, "PROD_BATCH_SLOTS", 0))


def enabled() -> bool:
    return slots() > 0


def takes(job: dict[str, Any]) -> bool:
    """Whether the batch loop serves this prod job (its wire form: batching on, the local path)."""
    return enabled() and job.get("path") == VerificationPath.LOCAL


def prefix_cache() -> PrefixCache | None:
    """A new decoder's prefix cache (ACE_PREFIX_CACHE_MB; None when 0)."""
    mib = int(getattr(settings, "PROD_PREFIX_CACHE_MB", 0))
    return PrefixCache(mib * 2**20) if mib > 0 else None


def capacity(processes: int) -> int:
    """Prod jobs a worker with this many processes serves at once (what it declares to admission control)."""
    return processes * slots() if enabled() else processes


_single_stream = threading.RLock()


@contextmanager
def single_stream() -> Iterator[None]:
    """Hold while using a model's own KV cache (single-stream engine work) in a process that batches."""
    if not enabled():
        yield
        return
    with _single_stream:
        yield


def on_loop_thread(fn: Callable[[], Any], *, timeout_s: float = 120.0) -> Any:
    """fn run in the batch loop's thread between two of its steps, for torch work that must run as prod's steps run:
    on a CPU each thread that calls torch has its own OpenMP team, and while two teams of a process have more
    threads than the cores, libgomp cuts their spin-waits and every parallel region wakes sleeping threads
    (measured on the demo pair at 2 threads: the decoder's verify(1) 4 ms in a process's only torch thread, 9 ms
    in a second one). A cost calibration timed in the Celery task's thread would not see what prod's steps pay."""
    return _loop().call(fn, timeout_s=timeout_s)


def hand_off(job: dict[str, Any], run: Callable[[dict[str, Any]], None]) -> None:
    """Run ``run(job)`` in a request thread of this process; returns at once."""

    def serve() -> None:
        from django.db import connection

        from speculation.worker import openmp

        openmp.side_thread()
        try:
            run(job)
        finally:
            connection.close()  # the thread's own database connection

    threading.Thread(target=serve, name=f"ace-prod-{job['request_id'][:12]}", daemon=True).start()


def serves(prepared: Any) -> bool:
    """The batch serves the local path with a draft model, n-gram lookup or suffix decoding, and the hybrid of a
    lookup with a draft model's fallback (not EAGLE heads: single-stream). Models transformers runs for ACE
    (implementation "generic", speculation.engine.generic) are served at batch one: the batch loop runs the native
    layer's blocks over its own cache."""
    if not enabled() or prepared.target is None:
        return False
    if getattr(prepared.target.model, "implementation", "native") != "native":
        return False
    return batch_form(prepared.proposer) is not None


def speculate(
    prepared: Any,
    *,
    config: GenerationConfig,
    prompt_ids: list[int],
    emit: Callable[[CommittedBatch], bool | None],
) -> None:
    """speculation.worker.generation.speculate for a request the batch serves: emit gets each step's batch."""
    form = batch_form(prepared.proposer)
    handle = _loop().submit(
        target=prepared.target.model,
        draft=form.draft,
        draft_width=form.width,
        lookup=form.lookup,
        prompt_ids=prompt_ids,
        config=config,
        costs=prepared.costs,
    )
    try:
        for update in handle.updates(timeout_s=settings.PROD_STEP_TIMEOUT_S):
            batch = CommittedBatch(
                ids=update.tokens,
                drafted=update.drafted,
                accepted=update.accepted,
                finished=update.finish_reason == "stop",
                looked_up=update.looked_up,
            )
            if emit(batch):  # a stop string matched: the request is done
                return
    finally:
        handle.close()


@dataclass
class _Handle:
    """A request thread's end of one slot: the loop puts its updates (or a failure) here."""

    loop: BatchLoop
    key: int
    inbox: queue.Queue = field(default_factory=queue.Queue)
    closed: bool = False

    def updates(self, *, timeout_s: float) -> Iterator[SlotUpdate]:
        while True:
            try:
                item = self.inbox.get(timeout=timeout_s)
            except queue.Empty:
                raise BatchFailed(f"the batch loop sent nothing for {timeout_s:g} s") from None
            if isinstance(item, BaseException):
                raise BatchFailed(f"batch error: {type(item).__name__}: {item}") from item
            yield item
            if item.finish_reason:
                self.closed = True
                return

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.loop.leave(self.key)


@dataclass
class _Group:
    """One (target, draft) pair's decoder, its waiting joins and its handles."""

    decoder: BatchDecoder
    pending: deque = field(default_factory=deque)  # (handle, prompt_ids, config) waiting for a free slot
    handles: dict[int, _Handle] = field(default_factory=dict)
    used: float = field(default_factory=time.monotonic)


class BatchLoop:
    """The one thread of a worker process that steps every decoder; request threads talk to it by commands."""

    def __init__(self, *, slots: int, load_aware_k: bool) -> None:
        self.slots = slots
        self.load_aware_k = load_aware_k
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._groups: dict[tuple, _Group] = {}
        self._ids = itertools.count(1)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ace-batch-loop", daemon=True)
        self._thread.start()

    def submit(
        self,
        *,
        target: Any,
        draft: Any,
        lookup: LookupProposer | None,
        prompt_ids: list[int],
        config: Any,
        costs: Any = None,
        draft_width: int | None = None,
    ) -> _Handle:
        """Join the batch of (target, draft model, lookup: requests whose lookups have the same batch_key share
        one, the first one's proposer drafting for all; both: the hybrid); the handle gets its steps. costs: the
        stored calibration of the request's path (StepCosts), where a pair's load-aware K starts at load 1.
        draft_width: the ids the draft drafts among (DraftModelProposer.width: a draft padding its vocabulary to
        another size than the target's)."""
        handle = _Handle(loop=self, key=next(self._ids))
        pair = (target, draft, lookup.batch_key if lookup is not None else None, draft_width)
        self._commands.put(("join", pair, handle, prompt_ids, config, costs, lookup))
        return handle

    def leave(self, key: int) -> None:
        self._commands.put(("leave", key))

    def call(self, fn: Callable[[], Any], *, timeout_s: float) -> Any:
        """fn's result, run in this loop's thread between two steps (its exception raised here)."""
        done: Future = Future()
        self._commands.put(("call", fn, done))
        return done.result(timeout=timeout_s)

    def stop(self) -> None:
        """End the loop thread; requests still in it fail (and fall back)."""
        self._stopped.set()
        self._commands.put(("stop",))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        from speculation.worker import openmp

        self._threads = openmp.BatchLoopThreads()
        while not self._stopped.is_set():
            busy = any(len(g.decoder) or g.pending for g in self._groups.values())
            self._take_commands(block=not busy)
            for pair, group in list(self._groups.items()):
                self._step(pair, group)
            self._drop_idle()
        for group in self._groups.values():
            self._fail(group, BatchFailed("the batch loop stopped"))

    def _take_commands(self, *, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_DROP_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command[0] == "stop":
                return
            if command[0] == "call":
                _, fn, done = command
                self._threads.size(1)  # a calibration times one request's steps, as prod runs them at load 1
                try:
                    done.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets it
                    done.set_exception(exc)
            elif command[0] == "join":
                _, pair, handle, prompt_ids, config, costs, lookup = command
                group = self._groups.get(pair) or self._new_group(pair, handle, lookup)
                if group is not None:
                    group.pending.append((handle, prompt_ids, config))
                    lookahead = group.decoder.lookahead
                    if costs is not None and lookahead is not None:
                        lookahead.seed(1, verify_s=costs.verify_s, draft_step_s=costs.draft_step_s)
            else:
                self._leave(command[1])
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _new_group(self, pair: tuple, handle: _Handle, lookup: LookupProposer | None) -> _Group | None:
        target, draft, _, draft_width = pair
        try:
            decoder = BatchDecoder(
                target,
                slots=self.slots,
                draft=draft,
                shared_vocab=draft_width,
                ngram=lookup,
                lookahead=LoadAwareLookahead() if self.load_aware_k else None,
                max_context=target.max_len,
                prefix_cache=prefix_cache(),
            )
        except Exception as exc:  # noqa: BLE001 - the request falls back with the reason
            handle.inbox.put(exc)
            return None
        self._groups[pair] = group = _Group(decoder=decoder)
        return group

    def _leave(self, key: int) -> None:
        for group in self._groups.values():
            if group.handles.pop(key, None) is not None:
                group.decoder.remove(key)
                return
            for waiting in list(group.pending):
                if waiting[0].key == key:
                    group.pending.remove(waiting)
                    return

    def _step(self, pair: tuple, group: _Group) -> None:
        decoder = group.decoder
        if group.pending and decoder.free:
            self._threads.prefill()
        while group.pending and decoder.free:  # joins take part in this step
            handle, prompt_ids, config = group.pending.popleft()
            try:
                decoder.add(handle.key, prompt_ids, config)
                group.handles[handle.key] = handle
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                handle.inbox.put(exc)
        if not len(decoder) and not group.handles:
            return
        group.used = time.monotonic()
        self._threads.size(len(decoder))
        try:
            updates = decoder.step()
        except Exception as exc:  # noqa: BLE001 - every request of the batch falls back; the loop goes on
            logger.exception("batch step failed; %d requests fall back", len(group.handles))
            self._fail(group, exc)
            del self._groups[pair]
            return
        for update in updates:
            handle = group.handles.get(update.key)
            if handle is not None:
                handle.inbox.put(update)
                if update.finish_reason:
                    del group.handles[update.key]

    @staticmethod
    def _fail(group: _Group, exc: BaseException) -> None:
        for handle in [*group.handles.values(), *(waiting[0] for waiting in group.pending)]:
            handle.inbox.put(exc)
        group.handles.clear()
        group.pending.clear()

    def _drop_idle(self) -> None:
        now = time.monotonic()
        for pair, group in list(self._groups.items()):
            if not len(group.decoder) and not group.pending and now - group.used > IDLE_DROP_S:
                del self._groups[pair]


_the_loop: BatchLoop | None = None
_loop_lock = threading.Lock()


def _loop() -> BatchLoop:
    global _the_loop
    with _loop_lock:
        if _the_loop is None:
            _the_loop = BatchLoop(slots=slots(), load_aware_k=bool(getattr(settings, "PROD_BATCH_LOAD_AWARE_K", True)))
        return _the_loop
