"""A prod request's tokens on their way to the gateway: the stop rules applied one committed token at a time, and
each verification's kept tokens sent with the text they complete (speculation.jobs.channel.Tokens). Prod's
generation and the step timers (speculation.worker.step_timing) run the same per-step work through it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from speculation.jobs.channel import Tokens

if TYPE_CHECKING:
    from speculation.jobs.admission import JobSlot
    from speculation.jobs.channel import WorkerChannel
    from speculation.worker.paths.stopping import StopMatcher


class TokenStream:
    """The request's stop rules applied one committed token at a time (the matcher is set once the tokenizer is
    loaded), and each verification's kept tokens sent to the gateway with the text they complete."""

    def __init__(self, channel: WorkerChannel, slot: JobSlot) -> None:
        self.channel, self.slot = channel, slot
        self.matcher: StopMatcher | None = None
        self.sent = 0
        self.ids: list[int] = []  # the tokens sent (what suffix decoding stores afterwards)
        self._text: list[str] = []
        self._first: tuple[float, int] | None = None  # when the first step's tokens came, and how many

    def decode_tok_s(self, ended: float) -> float | None:
        """Tokens after the first step over the time after it (perf_counter `ended`); None with one step only."""
        if self._first is None or self.sent <= self._first[1] or ended <= self._first[0]:
            return None
        return (self.sent - self._first[1]) / (ended - self._first[0])

    def ends_after(self, token: int) -> bool:
        assert self.matcher is not None
        self._text.append(self.matcher.feed([token])[1])
        return self.matcher.finished

    def send(self, ids: list[int]) -> None:
        if self._first is None:
            self._first = (time.perf_counter(), len(ids))
        text, self._text = "".join(self._text), []
        self.sent += len(ids)
        self.ids += ids
        # one round trip: the tokens out, the slot refreshed, and Cancelled raised when the client went away
        self.channel.send(Tokens(ids, text), slot=self.slot)
