"""The switch canary: before the route moves to a new instance that speculates, check that its greedy answers
are the plain server's while they share a batch with sampled requests.

Why: vLLM 0.32 (CPU build) with speculation on (n-gram or draft model) gives wrong greedy outputs for greedy
requests batched together with sampled ones, while the same greedy request alone is right
(scripts/repro_vllm_mixed_batch.py, docs/BENCHMARKS.md). A mode switch must never make an endpoint less
correct, so a new speculating instance that fails this check is not routed: the switch is rolled back and the
endpoint keeps serving from its instance without speculation (fleet.managed.supervisor).

The check, a handful of short requests (2 prompts, 16 tokens each):
1. the reference: each prompt's greedy answer from the old instance when it runs without speculation (what
   off answers), else from the new instance with the prompt sent alone (the defect needs a mixed batch);
2. the mixed batch: on the new instance, at once, GREEDY_EACH greedy and SAMPLED_EACH temperature 0.7
   requests of each prompt (8 requests);
3. every greedy answer of the batch must equal its prompt's reference.

`settings.MANAGED_SWITCH_CANARY` (ACE_MANAGED_CANARY, default true) turns it off; the choice is made when the
switch is requested and recorded with it, like the canary's outcome (Switch.canary).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

logger = logging.getLogger(__name__)

PROMPTS = (
    "for i in range(10):\n    print(i)\nfor i in range(10):\n",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
)
MAX_TOKENS = 16
GREEDY_EACH = 2
SAMPLED_EACH = 2
SAMPLED_TEMPERATURE = 0.7
TIMEOUT_S = 180.0
DEFECT = "server gives wrong greedy output under mixed batches with speculation on"
SKIP_SETTING = "ACE_MANAGED_CANARY"

# Switch.canary outcomes.
PENDING, PASSED, FAILED, SKIPPED, NOT_NEEDED, NOT_RUN = (
    "pending",
    "passed",
    "failed",
    "skipped",
    "not needed",
    "not run",
)


@dataclass
class CanaryResult:
    outcome: str
    reason: str = ""
    reference: str = ""  # where the greedy reference came from
    greedy: int = 0  # greedy answers compared
    mismatches: int = 0
    first_mismatch: dict[str, str] | None = None
    seconds: float = 0.0

    @property
    def refused(self) -> bool:
        return self.outcome == FAILED

    def record(self) -> dict[str, Any]:
        """What Switch.canary and the policy's change history keep."""
        value: dict[str, Any] = {"outcome": self.outcome, "reason": self.reason}
        if self.outcome in (PASSED, FAILED):
            value.update(
                reference=self.reference,
                greedy=self.greedy,
                mismatches=self.mismatches,
                requests=len(PROMPTS) * (1 + GREEDY_EACH + SAMPLED_EACH),
                seconds=round(self.seconds, 3),
            )
            if self.first_mismatch:
                value["first_mismatch"] = self.first_mismatch
        return value


def requested(enabled: bool, speculation: dict[str, Any]) -> dict[str, Any]:
    """Switch.canary when a switch is requested: what the supervisor will do before moving the route."""
    if not speculation:
        return {"outcome": NOT_NEEDED, "reason": "the new instance runs without speculation"}
    if not enabled:
        return {"outcome": SKIPPED, "reason": f"turned off ({SKIP_SETTING}=false)"}
    return {"outcome": PENDING, "reason": ""}


def _complete(base_url: str, model: str, prompt: str, temperature: float) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": temperature}
    response = httpx.post(base_url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _reference(*, new_url: str, old_url: str | None, model: str) -> tuple[list[str], str]:
    """Each prompt's greedy answer, sent one at a time, and where it came from."""
    if old_url:
        try:
            return [_complete(old_url, model, p, 0.0) for p in PROMPTS], "the old instance, without speculation"
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
            logger.warning("canary: the old instance gave no reference (%s); the new one alone does", exc)
    return [_complete(new_url, model, p, 0.0) for p in PROMPTS], "the new instance, each prompt alone"


def _mixed_batch(new_url: str, model: str) -> list[tuple[int, float, str]]:
    """(prompt index, temperature, text) of every request of one concurrent mixed batch on the new instance."""
    jobs = [(i, t) for i in range(len(PROMPTS)) for t in [0.0] * GREEDY_EACH + [SAMPLED_TEMPERATURE] * SAMPLED_EACH]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        texts = list(pool.map(lambda job: _complete(new_url, model, PROMPTS[job[0]], job[1]), jobs))
    return [(i, t, text) for (i, t), text in zip(jobs, texts, strict=True)]


def run(*, new_url: str, model: str, old_url: str | None) -> CanaryResult:
    """Check the new instance (old_url: the old instance when it runs without speculation, else None)."""
    started = time.perf_counter()
    try:
        reference, source = _reference(new_url=new_url, old_url=old_url, model=model)
        batch = _mixed_batch(new_url, model)
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        reason = f"the new instance did not answer the switch canary's requests: {type(exc).__name__}: {exc}"
        return CanaryResult(FAILED, reason[:1000], seconds=time.perf_counter() - started)
    greedy = [(i, text) for i, t, text in batch if t == 0.0]
    wrong = [(i, text) for i, text in greedy if text != reference[i]]
    result = CanaryResult(
        PASSED, reference=source, greedy=len(greedy), mismatches=len(wrong), seconds=time.perf_counter() - started
    )
    if wrong:
        i, text = wrong[0]
        result.outcome = FAILED
        result.first_mismatch = {"prompt": PROMPTS[i], "expected": reference[i], "got": text}
        result.reason = (
            f"{DEFECT} (vLLM defect, see scripts/repro_vllm_mixed_batch.py): {len(wrong)} of {len(greedy)} greedy "
            f"answers batched with temperature {SAMPLED_TEMPERATURE} requests differ from {source}; "
            f"first: expected {reference[i]!r}, got {text!r}"
        )
    logger.info("switch canary on %s: %s (%d of %d greedy wrong)", new_url, result.outcome, len(wrong), len(greedy))
    return result
