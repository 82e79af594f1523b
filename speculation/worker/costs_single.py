"""Timing the local path as prod runs it single-stream (an EAGLE head, a model transformers runs for ACE, any
proposer the worker's batch loop does not serve: speculation.worker.batching.serves).

Prod runs such a request through the engine's own loop (speculation.engine.decode.generate) in one thread, and that
thread also does the request's part of each step between two steps: the stop matcher a token at a time and one
send to the gateway (speculation.worker.stream.TokenStream). ``SingleStepTimer`` times steps of that loop with prod's
own proposer (an EAGLE head fed the target's real features, its catch-up on the accepted tokens included) at a fixed
K, each step's tokens relayed before the next step starts (``StepRelay``, waited for). A step of K = n - 1 gives
verify(n) as everything the step costs besides drafting (the verification, the acceptance rule, the relay) and the
draft step as its drafting time per drafted token. Measured on the demo pair with the shipped head at K = 3, one
torch thread: the loop's draft took 2.9-4.5 ms a step where the draft step timed alone (8 tokens a proposal, one
feature row fed) projected 1.9, and the relay 0.8-2.8 ms a step, which no timing of the forwards alone contains;
on a quiet machine these steps projected 11.4-11.7 ms where prod's loop with its relay ran at 11.3-11.8.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from speculation.engine import GenerationConfig
from speculation.engine.decode import generate
from speculation.engine.target import Target

STEPS_PER_SIZE = 3  # steps run at each K per round; the first (the prompt's prefill before it) is not kept
RELAY_WAIT_S = 5.0  # a relay that hangs (Redis gone) does not hold the calibration
RELAY_POLL_S = 0.0001


class _Timed:
    """Prod's proposer, its proposals timed (the loop's own timing of them is not handed to on_tokens)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last: tuple[int, float] | None = None  # drafted, seconds

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, committed: list[int], k: int, params: Any, generator: Any, **shape: Any) -> Any:
        started = time.perf_counter()
        proposal = self.inner.propose(committed, k, params, generator, **shape)
        self.last = (int(proposal.tokens.shape[0]), time.perf_counter() - started)
        return proposal


class SingleStepTimer:
    """Steps of prod's single-stream loop, timed as they run: ``round`` runs STEPS_PER_SIZE steps at each size n
    (K = n - 1, largest first) and returns ({n: [seconds of the step besides drafting]}, [seconds per drafted
    token]). relay: called with each step's committed tokens and returning when they are relayed."""

    def __init__(
        self,
        target: Target,
        proposer: Any,
        *,
        context: list[int],
        relay: Callable[[list[int]], None] | None = None,
    ) -> None:
        self._target, self._proposer, self._context = target, _Timed(proposer), list(context)
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
        """(drafted, draft seconds, step seconds) of the steps after the first, each step from the end of the
        previous step's relay to the end of its own."""
        steps: list[tuple[int, float, float]] = []
        ended = [0.0]

        def on_tokens(ids: list[int]) -> bool:
            if self._relay is not None:
                self._relay(list(ids))
            now = time.perf_counter()
            if ended[0]:
                drafted, draft_s = self._proposer.last or (0, 0.0)  # K = 0: no proposal
                steps.append((drafted, draft_s, now - ended[0]))
            ended[0], self._proposer.last = now, None
            return len(steps) >= STEPS_PER_SIZE - 1

        room = self._target.max_context - len(self._context) - 1
        config = GenerationConfig(max_new_tokens=room, k=k, temperature=0.0)
        generate(self._target, self._proposer, self._context, config, on_tokens)
        return steps


def waited(relay: Any) -> Callable[[list[int]], None]:
    """A StepRelay (speculation.worker.costs_batch) made inline: each step's tokens handed to it and waited for, as
    prod's request thread relays them itself before its next step."""

    def relay_now(ids: list[int]) -> None:
        done, deadline = relay.relayed + 1, time.monotonic() + RELAY_WAIT_S
        relay.put(ids)
        while relay.relayed < done and time.monotonic() < deadline:
            time.sleep(RELAY_POLL_S)

    return relay_now
