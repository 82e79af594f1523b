"""The sampling a prod request asks for, and whether its path can serve it exactly.

vLLM's semantics (vllm/v1/sample): temperature below 1e-5 is greedy; the logits are divided by the temperature,
then top-k keeps the k largest (-1 or 0 = off), then top-p keeps the smallest set whose mass reaches p, and
the result is renormalised. The worker applies exactly that to the target's (p) and the draft's (q) logits
(speculation.engine.sampling.probs_from_logits). A request without a seed gets a fresh random one: the same
seed gives the same output, no seed gives independent samples, as with the server itself.

- local path: the worker holds the target's logits, so any temperature / top-k / top-p is exact.
- remote path: the target's distribution is known only through its top-N log-probabilities (N = the probed
  max_logprobs). The processed distribution is fully known when top-k < N: its support is the top-k tokens,
  all returned, and the (k+1)-th shows whether a tie crosses the cut. Anything else is skipped with the reason.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from speculation.models import VerificationPath
from speculation.openai_fields import is_greedy

_OFF_TOP_K = (None, 0, -1)


@dataclass(frozen=True)
class RequestSampling:
    temperature: float
    top_k: int  # 0 = off
    top_p: float  # 1 = off
    seed: int | None

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    def job(self) -> dict[str, Any]:
        """What the worker's GenerationConfig takes; a request without a seed gets a random one here."""
        if self.greedy:
            return {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}
        seed = self.seed if self.seed is not None else secrets.randbits(63)
        job = {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p, "seed": seed}
        if self.seed is None:  # nothing to reproduce: the worker's batch loop may choose K for it (fixed_k)
            job["seeded"] = False
        return job

    def upstream(self) -> dict[str, Any]:
        """The same sampling as request fields for the server (a plain continuation after a failure)."""
        if self.greedy:
            return {"temperature": 0}
        fields: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        if self.top_k:
            fields["top_k"] = self.top_k
        return fields


def _number(body: dict[str, Any], name: str, default: float) -> float | str:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        return f"{name} {value!r} is not a number"
    return float(value)


def parse(body: dict[str, Any]) -> RequestSampling | str:
    """The request's sampling, or the reason it cannot be served exactly (the server answers bad values)."""
    temperature = _number(body, "temperature", 1.0)
    top_p = _number(body, "top_p", 1.0)
    if isinstance(temperature, str):
        return temperature
    if isinstance(top_p, str):
        return top_p
    if not temperature >= 0.0:
        return f"temperature {temperature} < 0"
    if not 0.0 < top_p <= 1.0:
        return f"top_p {top_p} outside (0, 1]"
    top_k = body.get("top_k")
    if top_k in _OFF_TOP_K:
        top_k = 0
    elif isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        return f"top_k {top_k!r} is not -1, 0 or a positive integer"
    min_p = body.get("min_p")
    if min_p not in (None, 0, 0.0):
        return f"unsupported parameter min_p={min_p!r}: prod applies temperature, top-k and top-p only"
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        return f"seed {seed!r} is not an integer"
    return RequestSampling(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p), seed=seed)


def path_reason(sampling: RequestSampling, *, path: str, capabilities: dict[str, Any]) -> str:
    """Why this path cannot serve this sampling exactly ("" when it can)."""
    if sampling.greedy or path != VerificationPath.REMOTE:
        return ""
    top_n = int(capabilities.get("max_logprobs") or 0)
    if not 0 < sampling.top_k < top_n:
        shown = f"top_k={sampling.top_k}" if sampling.top_k else "no top_k"
        return (
            f"temperature {sampling.temperature:g} with {shown} on the remote path: the processed distribution is "
            f"fully known from the server's top-{top_n} log-probabilities only when 0 < top_k < {top_n}"
        )
    return ""
