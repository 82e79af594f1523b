"""The goodput guard's rules: pure functions of measurements, no clock, no Redis, no settings.

Two rules decide whether a prod request speculates:

- `by_cost`, per request: the cost model predicts the request's gain over plain serving from its expected length (its
  max tokens), the measured step costs (target step, c, v(K), the speculative path's setup per request) and the
  expected tokens per verification E[N]. A request too short to pay the setup back goes plain; a long one can gain
  up to the bound E[N] / (v + K c) (docs ANCHORS section 1). Measured goodput corrects the prediction per load and
  length bucket (`correction`) instead of replacing it with one verdict for every length.
- `choose`, per load bucket: above one request in flight a speculating request slows its neighbours, which step
  costs measured at one stream do not predict; there the measured goodput of the load decides (a verdict, learned
  one request at a time), as it does at every load while no cost model is measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speculation.openai_fields import is_greedy

WINDOW = 20
MIN_SAMPLES = 8
EARLY_SAMPLES = 4
FEW_SAMPLES = 2
# The early rules (EARLY_SAMPLES, FEW_SAMPLES) decide above one request in flight only, where a slow learner slows its
# neighbours too. Alone it slows no one, and its first requests run while the worker warms up.
LEARNERS_IN_FLIGHT = 1
# Above one request in flight, speculation counts as faster only at this multiple of plain's goodput: a right
# "faster" gains a share of one stream, a wrong one slows every neighbour, and the two sides' samples are taken at
# different moments of a drifting machine.
CROWDED_MARGIN = 1.25
# Where the worker's batch takes every request of the load, a right "faster" gains on every stream: the margin
# covers only the drift between the moments the two sides were sampled at.
BATCHED_MARGIN = 1.1
# A verdict's goodput leaves out each side's longest-running sample (a worker's cold start must not decide alone).
TRIM = 1
SPEC_TTL_S = 900  # speculative samples: a load's verdict lasts this long from its first sample, then is re-learned
BUCKETS = ((1, "1"), (4, "2-4"), (16, "5-16"))
TOP_BUCKET = "17+"
BUCKET_NAMES = (*(name for _, name in BUCKETS), TOP_BUCKET)
# Output lengths the measured goodput corrects the cost model for separately (a sample's tokens, a request's max).
LENGTHS = ((16, "1-16"), (64, "17-64"), (256, "65-256"))
TOP_LENGTH = "257+"
CORRECTION_SAMPLES = 4  # samples on each side of a length bucket before its own goodput corrects the prediction

SPEC = "spec"
PLAIN = "plain"
GREEDY = "greedy"
SAMPLED = "sampled"
TRAFFIC = (GREEDY, SAMPLED)
GUARD = "goodput guard"
SHARED_REASON = (
    "the worker's engine shares the server's machine: a speculating request takes the cores the plain ones beside "
    "it wait for (ACE_GOODPUT_SHARED_LEARN=true learns this load instead)"
)

Sample = float | tuple[float, float]  # a request's tok/s, with the seconds it ran (a bare tok/s weighs 1 s)
Samples = Mapping[tuple[str, str, str], Sequence[Sample]]  # (traffic, bucket, SPEC | PLAIN) -> per request


@dataclass(frozen=True)
class Decision:
    plain: bool
    reason: str = ""
    probe: bool = False  # speculates to learn a load that has no verdict yet
    samples: Samples | None = field(default=None, compare=False, repr=False)  # what it was decided on (reconsider)
    shared: bool = field(default=False, compare=False, repr=False)  # the worker shares the server's machine
    batched: bool = field(default=False, compare=False, repr=False)  # the worker's batch takes the whole load
    tokens: int | None = field(default=None, compare=False, repr=False)  # the request's expected output length
    model: CostModel | None = field(default=None, compare=False, repr=False)  # the cost model it was decided by


def bucket_of(in_flight: int) -> str:
    for bound, name in BUCKETS:
        if in_flight <= bound:
            return name
    return TOP_BUCKET


def length_of(tokens: float) -> str:
    for bound, name in LENGTHS:
        if tokens <= bound:
            return name
    return TOP_LENGTH


def traffic_of(body: Mapping[str, Any]) -> str:
    """Greedy or sampled, as the server reads the request (no temperature: OpenAI's and vLLM's default, 1)."""
    return GREEDY if is_greedy(body.get("temperature")) else SAMPLED


def tok_s(sample: Sample) -> float:
    return sample[0] if isinstance(sample, tuple) else float(sample)


def tokens_of(sample: Sample) -> float | None:
    """The output tokens of a sample (tok/s x seconds); None for a bare tok/s, kept before the seconds were."""
    return sample[0] * sample[1] if isinstance(sample, tuple) else None


def goodput(samples: Sequence[Sample], *, trim: int = 0) -> float:
    """Tokens / seconds over the samples: each request's tok/s weighted by the seconds it ran; `trim`: without that
    many of the longest-running ones (a worker's cold start, a pause: one request must not decide alone)."""
    pairs = [s if isinstance(s, tuple) else (float(s), 1.0) for s in samples]
    if trim and len(pairs) > trim:
        pairs = sorted(pairs, key=lambda pair: pair[1])[:-trim]
    seconds = sum(sec for _, sec in pairs)
    return sum(rate * sec for rate, sec in pairs) / seconds if seconds > 0 else 0.0


def verdict(
    spec: Sequence[Sample], plain: Sequence[Sample], *, bucket: str = BUCKET_NAMES[0], batched: bool = False
) -> str:
    """ "slower" / "faster" where the samples of one load say so, "" where they do not yet. Above one request in
    flight "faster" needs CROWDED_MARGIN times plain's goodput ("slower" covers "not that much faster"), or
    BATCHED_MARGIN where the worker's batch takes the whole load."""
    if len(plain) < MIN_SAMPLES:
        return ""
    if len(spec) >= MIN_SAMPLES:
        margin = 1.0 if bucket == BUCKET_NAMES[0] else BATCHED_MARGIN if batched else CROWDED_MARGIN
        return "slower" if goodput(spec, trim=TRIM) < margin * goodput(plain, trim=TRIM) else "faster"
    if bucket == BUCKET_NAMES[0]:  # alone, a request slows no neighbour: MIN_SAMPLES decide (see FEW_SAMPLES)
        return ""
    spec_rates, plain_rates = [tok_s(s) for s in spec], [tok_s(s) for s in plain]
    if len(spec) >= EARLY_SAMPLES and max(spec_rates) < statistics.median(plain_rates):
        return "slower"
    if len(spec) >= FEW_SAMPLES and max(spec_rates) < min(plain_rates):
        return "slower"
    return ""


def figures(spec: Sequence[Sample], plain: Sequence[Sample]) -> str:
    return (
        f"goodput {goodput(spec, trim=TRIM):.1f} vs {goodput(plain, trim=TRIM):.1f} tok/s per stream (tokens / "
        f"seconds, each side's longest request left out) over the last {len(spec)} / {len(plain)} requests"
    )


def presumed_slower(samples: Samples, *, traffic: str, bucket: str) -> str:
    """Why speculation is presumed slower at a load it has not been measured at enough ("" when it is not)."""

    def slower(kind: str, name: str) -> bool:
        spec, plain = samples.get((kind, name, SPEC), ()), samples.get((kind, name, PLAIN), ())
        return verdict(spec, plain, bucket=name) == "slower"

    lower = BUCKET_NAMES[: BUCKET_NAMES.index(bucket)]
    for name in reversed(lower):
        if slower(traffic, name):
            return f"{traffic} speculation measured slower than plain at the lower load {name}"
    if traffic == SAMPLED:
        for name in reversed((*lower, bucket)):
            if slower(GREEDY, name):
                return f"greedy speculation measured slower than plain at load {name}"
    return ""


def choose(
    samples: Samples,
    *,
    traffic: str,
    bucket: str,
    turn: int,
    learning: int = 0,
    speculating: int = 0,
    pending: int = 0,
    held: bool = False,
    shared: bool = False,
    batched: bool = False,
    cap: int = 1,
) -> Decision:
    """The rule, on the samples of one endpoint, for a request of this traffic at this load; turn counts the
    requests of that traffic and load, learning the endpoint's speculated requests in flight that learn a load,
    speculating all its speculated requests in flight, pending its other requests in flight whose samples will be
    speculation's (the speculating ones and the plain ones beside them), held whether a "slower" verdict reached
    earlier at this load still holds (hold_slower), shared whether the worker's engine shares the server's machine
    (shares_machine: then a load above one request in flight without a verdict is presumed slower, not learned),
    batched whether the worker's batch takes every request of this load (batch_takes: then the load is learned and,
    measured faster, served with every request speculating, the regime it was measured in; decide() passes it only
    where the worker does not share the server's machine), cap how many of the endpoint's requests may speculate at
    once above one in flight (ACE_GOODPUT_SPECULATING)."""
    spec, plain = samples.get((traffic, bucket, SPEC), ()), samples.get((traffic, bucket, PLAIN), ())
    own = "slower" if held else verdict(spec, plain, bucket=bucket, batched=batched)
    if own == "faster":
        cap = max(1, cap)
        if batched:
            return Decision(
                plain=False,
                reason=f"{GUARD}: speculation measured faster at load {bucket} with the load on the worker's batch",
            )
        if bucket != BUCKET_NAMES[0] and speculating >= cap:
            return Decision(
                plain=True,
                reason=f"speculation measured faster at load {bucket} with at most {cap} of the endpoint's requests "
                f"speculating; {speculating} already are ({GUARD})",
            )
        return Decision(plain=False, reason=f"{GUARD}: speculation measured faster at load {bucket}")
    if held:
        return Decision(
            plain=True,
            reason=f"speculation measured slower than plain at this load, a verdict held {SPEC_TTL_S} s ({GUARD}); "
            f"now {figures(spec, plain)}",
        )
    if own == "slower":
        if len(spec) >= MIN_SAMPLES and goodput(spec, trim=TRIM) >= goodput(plain, trim=TRIM):  # within the margin
            return Decision(
                plain=True,
                reason=f"speculation measured less than {CROWDED_MARGIN}x plain's goodput at this load ({GUARD}): "
                f"{figures(spec, plain)}",
            )
        return Decision(
            plain=True,
            reason=f"speculation measured slower than plain at this load ({GUARD}): {figures(spec, plain)}",
        )
    presumed = presumed_slower(samples, traffic=traffic, bucket=bucket)
    if not presumed and shared and bucket != BUCKET_NAMES[0]:
        presumed = SHARED_REASON
    if presumed:
        return Decision(plain=True, reason=f"{presumed}; not measured at load {bucket} ({GUARD})")
    if len(plain) < MIN_SAMPLES and len(spec) >= MIN_SAMPLES and turn % 2 == 1:
        return Decision(plain=True, reason=f"measuring plain speed at this load ({GUARD})")
    if batched and bucket != BUCKET_NAMES[0]:
        return Decision(
            plain=False, reason=f"{GUARD}: learning load {bucket} with the load on the worker's batch", probe=True
        )
    if learning >= LEARNERS_IN_FLIGHT:
        return Decision(
            plain=True,
            reason=f"learning load {bucket}: a speculated request in flight measures it first ({GUARD})",
        )
    if pending and len(spec) + pending >= MIN_SAMPLES:
        return Decision(
            plain=True,
            reason=f"learning load {bucket}: the {pending} requests in flight beside speculation finish first, "
            f"{len(spec)} of its samples kept ({GUARD})",
        )
    return Decision(plain=False, reason=f"{GUARD}: learning load {bucket}", probe=True)


@dataclass(frozen=True)
class CostModel:
    """What a speculated request costs against plain serving, as measured for the endpoint's policy: one plain step
    of the target, c = draft step / target step, v = verifying K + 1 tokens / target step, E[N] = tokens committed
    per verification, and the speculative path's setup per request beyond its steps (tokenize call, queue, the
    worker's prefill)."""

    target_step_s: float
    c: float
    v: float
    k: float  # drafts per verification (the policy's K, or the mean a dynamic K drafted)
    tokens_per_step: float
    setup_s: float

    @property
    def bound(self) -> float:
        """S = E[N] / (v + K c): the gain of a request long enough that its setup does not count."""
        return self.tokens_per_step / (self.v + self.k * self.c)

    def gain(self, tokens: float) -> float:
        """Plain's seconds for `tokens` over the speculative path's: n t / (setup + n t / S)."""
        plain_s = tokens * self.target_step_s
        return plain_s / (self.setup_s + plain_s / self.bound)

    def pays_from(self) -> float | None:
        """The output length from which speculation is predicted faster than plain (None: at no length)."""
        if self.bound <= 1.0:
            return None
        return self.setup_s / (self.target_step_s * (1.0 - 1.0 / self.bound))

    def basis(self) -> str:
        return (
            f"E[N] {self.tokens_per_step:.2f} tokens a step at K={self.k:g}, c={self.c:.3f}, v={self.v:.2f}, "
            f"{self.target_step_s * 1000:.1f} ms a target step, {self.setup_s * 1000:.0f} ms setup a request"
        )


@dataclass(frozen=True)
class Correction:
    """Measured gain / the cost model's predicted gain for one traffic kind, load and length bucket."""

    factor: float = 1.0
    basis: str = ""
    plain_missing: bool = False  # speculation measured there, plain not enough to compare with


def correction(samples: Samples, model: CostModel, *, traffic: str, bucket: str, length: str) -> Correction:
    """How far measured goodput is from the prediction for requests of this length at this load: both sides' samples
    whose output falls in the same length bucket (a short request's goodput is not a long one's), at least
    CORRECTION_SAMPLES each; the prediction at the speculated samples' lengths, weighted by their seconds."""

    def cell(kind: str) -> list[tuple[float, float]]:
        kept = samples.get((traffic, bucket, kind), ())
        return [s for s in kept if isinstance(s, tuple) and s[1] > 0 and length_of(s[0] * s[1]) == length]

    spec, plain = cell(SPEC), cell(PLAIN)
    where = f"{length}-token requests at load {bucket}"
    if len(spec) < CORRECTION_SAMPLES:
        return Correction(basis=f"no goodput measured for {where} yet")
    if len(plain) < CORRECTION_SAMPLES:
        return Correction(basis=f"plain goodput not measured for {where} yet", plain_missing=True)
    measured = goodput(spec) / goodput(plain)
    spec_tokens = [rate * sec for rate, sec in spec]
    predicted = sum(spec_tokens) / sum(n / model.gain(n) for n in spec_tokens)
    return Correction(
        factor=measured / predicted,
        basis=f"corrected by the goodput measured for {where}: {measured:.2f}x where it predicted {predicted:.2f}x "
        f"over the last {len(spec)} / {len(plain)} requests",
    )


def by_cost(
    samples: Samples,
    model: CostModel,
    *,
    tokens: int,
    traffic: str,
    bucket: str,
    turn: int = 0,
    batched: bool = False,
) -> Decision | None:
    """The rule per request: the cost model's gain for a request of `tokens` output tokens, corrected by measured
    goodput (`correction`). Plain below 1x at one request in flight (CROWDED_MARGIN above, or BATCHED_MARGIN where
    the worker's batch takes the load); at one request in flight it speculates otherwise. Above one it returns None
    for a request predicted to gain: the load's rule (`choose`) decides what its neighbours pay."""
    length = length_of(tokens)
    fix = correction(samples, model, traffic=traffic, bucket=bucket, length=length)
    gain = model.gain(tokens) * fix.factor
    alone = bucket == BUCKET_NAMES[0]
    need = 1.0 if alone else BATCHED_MARGIN if batched else CROWDED_MARGIN
    why = f"a request of up to {tokens} tokens is predicted {gain:.2f}x plain at load {bucket}"
    why += f" ({model.basis()}; {fix.basis})"
    if gain < need:
        pays = model.pays_from()
        short = f"; speculation pays from about {pays:.0f} tokens alone" if pays is not None else ""
        return Decision(plain=True, reason=f"{why}, below the {need:g}x it needs{short} ({GUARD})")
    if not alone:
        return None
    if fix.plain_missing and turn % 2 == 1:
        measuring = f"measuring plain speed of {length}-token requests at load {bucket}"
        return Decision(plain=True, reason=f"{measuring} ({GUARD})")
    return Decision(plain=False, reason=f"{GUARD}: {why}")
