"""Prod generation in the GPU worker: draft + verify on the chosen path, tokens streamed through Redis.

Both paths draft with the engine's proposers (speculation.engine). The local path is the engine's own loop
(`generate` on a LocalTarget); the remote path verifies through the target's scoring API, one call per step
(speculation.worker.paths.loop.greedy_speculate with speculation.worker.paths.remote.RemoteGreedyVerifier).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import redis
from django.conf import settings

from fleet.adapters import wire_for
from fleet.models import Endpoint
from fleet.netpolicy import PinnedTransport
from speculation.engine import (
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    NgramProposer,
    Proposal,
    SamplingParams,
    generate,
)
from speculation.jobs.admission import Cancelled, JobSlot
from speculation.jobs.channel import WorkerChannel
from speculation.models import Mechanism, SpeculationPolicy, VerificationPath
from speculation.worker import baseline
from speculation.worker.paths import CommittedBatch, SpecRunStats, resources
from speculation.worker.paths.drafting import StepProposer
from speculation.worker.paths.loop import greedy_speculate
from speculation.worker.paths.remote import RemoteGreedyVerifier, RemoteTopKTarget
from speculation.worker.paths.stopping import StopMatcher, StopRule
from speculation.worker.paths.text import IncrementalText, eos_token_ids

logger = logging.getLogger(__name__)

_http: httpx.Client | None = None


def http() -> httpx.Client:
    global _http
    if _http is None:
        # Sockets go only to addresses the network policy checked at connect time (fleet.netpolicy).
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        _http = httpx.Client(transport=PinnedTransport(limits=limits))
    return _http


def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=10)


class PathUnavailable(RuntimeError):
    """The policy's path cannot run here (missing tokenizer, target, draft)."""


def _headers(endpoint: Endpoint) -> dict[str, str]:
    key = endpoint.api_key
    return {"Authorization": f"Bearer {key}"} if key else {}


def _text_source(policy: SpeculationPolicy) -> str:
    if policy.draft is not None and policy.draft.path:
        return policy.draft.path
    if policy.target_path:
        return policy.target_path
    raise PathUnavailable("no tokenizer in the worker: n-gram drafting needs target_path (the target's model dir)")


class StepLog:
    """An engine proposer that also notes each step's (accepted, drafted), so the record keeps SpecRunStats'
    per-step counts (speculation.worker.paths.base) whichever path ran."""

    def __init__(self, proposer: Any) -> None:
        self.proposer = proposer
        self.wants_hidden = proposer.wants_hidden
        self.last: tuple[int, int] = (0, 0)

    def begin(self, prompt_ids: list[int]) -> None:
        self.proposer.begin(prompt_ids)

    def propose(self, committed: list[int], k: int, params: SamplingParams, generator: Any) -> Proposal:
        return self.proposer.propose(committed, k, params, generator)

    def on_verified(self, num_accepted: int, num_drafted: int) -> None:
        self.last = (num_accepted, num_drafted)
        self.proposer.on_verified(num_accepted, num_drafted)

    def observe_target(self, hidden: Any, num_accepted: int) -> None:
        self.proposer.observe_target(hidden, num_accepted)


@dataclass
class Prepared:
    """What one prod request runs with on this worker."""

    proposer: Any  # an engine proposer
    tokenizer: Any
    eos_ids: frozenset[int]
    verifier: RemoteGreedyVerifier | None = None  # remote path
    target: LocalTarget | None = None  # local path
    vocab_size: int = 0
    capabilities: dict[str, Any] | None = None  # the endpoint's probe (remote sampled: max_logprobs, max_context)

    def remote_target(self, top_k: int) -> RemoteTopKTarget:
        """The remote path for a sampled request (0 < top_k < the server's max logprobs)."""
        assert self.verifier is not None
        caps = self.capabilities or {}
        return RemoteTopKTarget(
            client=self.verifier.client,
            base_url=self.verifier.base_url,
            model=self.verifier.model,
            headers=self.verifier.headers,
            wire=self.verifier.wire,
            vocab_size=self.vocab_size,
            max_context=int(caps.get("max_context") or 1 << 30),
            top_k=top_k,
            top_n=int(caps.get("max_logprobs") or 0),
        )


def build(endpoint: Endpoint, policy: SpeculationPolicy, path: str) -> Prepared:
    """The engine proposer, the verifier or local target, tokenizer and eos ids for this policy on this worker."""
    target: LocalTarget | None = None
    if path == VerificationPath.LOCAL:
        if not policy.target_path:
            raise PathUnavailable("path local needs the policy's target_path")
        target = LocalTarget(resources.model(policy.target_path).model)
    elif path != VerificationPath.REMOTE:
        raise PathUnavailable(f"path {path!r} does not run in the worker")
    if policy.mechanism == Mechanism.NGRAM:
        proposer: Any = NgramProposer()
        source = _text_source(policy)
        tok = resources.tokenizer(source)
        eos = eos_token_ids(source, tok)
        vocab = target.vocab_size if target is not None else len(tok)
    else:
        if policy.draft is None or not policy.draft.path:
            raise PathUnavailable("the policy has no draft weights")
        try:
            draft = resources.model(policy.draft.path)
        except Exception as exc:  # noqa: BLE001 - any load failure is a draft error the gateway falls back from
            raise PathUnavailable(f"draft error: cannot load {policy.draft.name}: {type(exc).__name__}: {exc}") from exc
        vocab = target.vocab_size if target is not None else draft.model.vocab_size
        proposer = DraftModelProposer(draft.model, target_vocab_size=vocab)
        tok, eos = draft.tokenizer, draft.eos_ids
    if target is not None:
        return Prepared(proposer=proposer, tokenizer=tok, eos_ids=eos, target=target)
    verifier = RemoteGreedyVerifier(
        client=http(),
        base_url=endpoint.base_url,
        model=endpoint.served_model,
        headers=_headers(endpoint),
        wire=wire_for(endpoint.kind),
    )
    return Prepared(
        proposer=proposer,
        tokenizer=tok,
        eos_ids=eos,
        verifier=verifier,
        vocab_size=vocab,
        capabilities=dict(endpoint.capabilities or {}),
    )


SLOT_HOLD_S = settings.PROD_STEP_TIMEOUT_S + 60.0  # a step refreshes the job's slot; a dead worker's expires

GREEDY_JOB = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}


def speculate(
    prepared: Prepared,
    *,
    prompt_ids: list[int],
    max_tokens: int,
    k: int,
    emit: Callable[[CommittedBatch], bool | None],
    sampling: dict[str, Any] | None = None,
    stop: StopRule | None = None,
) -> None:
    """Run the prepared path (fixed K); emit gets each target verification's committed batch.

    sampling: temperature / top_k / top_p / seed as the gateway parsed them (speculation.gateway.sampling);
    None = greedy. Sampled requests run the engine's exact rejection sampling on either path.
    stop: the request's stop rule (its stop tokens, min_tokens); None = the model's end tokens. emit returns
    True when the request is finished (a stop string matched): no further step runs.
    """
    stop_ids = stop.stop_ids if stop is not None else prepared.eos_ids
    sampling = {**GREEDY_JOB, **(sampling or {})}
    if prepared.verifier is not None and sampling["temperature"] == 0.0:
        for batch in greedy_speculate(
            proposer=StepProposer(prepared.proposer),
            verifier=prepared.verifier,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            k=k,
            eos_ids=stop_ids,
        ):
            if emit(batch):
                return
        return
    # The local path (and the remote path for sampled requests) is the engine's loop (same draft length rule as
    # greedy_speculate's step_k); each step's tokens come through on_tokens: the accepted drafts + the target's
    # token, cut after a stop token.
    log = StepLog(prepared.proposer)
    target = prepared.target if prepared.target is not None else prepared.remote_target(int(sampling["top_k"]))

    def on_tokens(ids: list[int]) -> bool | None:
        accepted, drafted = log.last
        finished = bool(ids) and ids[-1] in stop_ids
        return emit(CommittedBatch(ids=ids, drafted=drafted, accepted=min(accepted, len(ids)), finished=finished))

    config = GenerationConfig(
        max_new_tokens=max_tokens,
        k=k,
        temperature=float(sampling["temperature"]),
        top_k=int(sampling["top_k"]),
        top_p=float(sampling["top_p"]),
        seed=int(sampling["seed"]),
        stop_token_ids=tuple(sorted(stop_ids)),
        min_tokens=stop.min_tokens if stop is not None else 0,
        suppress_ids=tuple(sorted(stop.suppressed_ids)) if stop is not None else (),
    )
    generate(target, log, prompt_ids, config, on_tokens=on_tokens)


def run_prod_generation(job: dict[str, Any]) -> None:
    """Generate one prod request; every outcome ends with a done or error message on the channel."""
    client = redis_client()
    channel = WorkerChannel(client, job["request_id"])
    slot = JobSlot(client, request_id=job["request_id"], node_class=job.get("node_class", ""), hold_s=SLOT_HOLD_S)
    stats = SpecRunStats(k=job["k"])
    try:
        slot.check()  # a job the gateway stopped waiting for never starts
        endpoint = Endpoint.objects.get(pk=job["endpoint_id"])
        policy = SpeculationPolicy.objects.select_related("draft").get(endpoint=endpoint)
        prepared = build(endpoint, policy, job["path"])
        base = baseline.baseline_tok_s(
            redis_client=client,
            endpoint_id=endpoint.pk,
            measure=lambda: baseline.calibrate(
                client=http(),
                base_url=endpoint.base_url,
                kind=endpoint.kind,
                model=endpoint.served_model,
                headers=_headers(endpoint),
                prompt_ids=job["prompt_ids"],
                max_tokens=job["max_tokens"],
            ),
        )
        channel.send({"type": "ready"}, slot=slot)  # loaded and calibrated: the gateway's step timeout applies
        rule = StopRule.from_fields(
            job.get("stop") or {},
            max_tokens=job["max_tokens"],
            eos_token_id=prepared.tokenizer.eos_token_id,
            eos_ids=prepared.eos_ids,
        )
        matcher = StopMatcher(rule, decode=IncrementalText(prepared.tokenizer).add)

        def emit(batch: CommittedBatch) -> bool:
            kept, delta = matcher.feed(batch.ids)  # tokens past a stop were never generated by plain decoding
            batch = CommittedBatch(
                ids=batch.ids[:kept],
                drafted=batch.drafted,
                accepted=min(batch.accepted, kept),
                finished=matcher.finished,
            )
            stats.add(batch)
            # one round trip: the tokens out, the slot refreshed, and Cancelled raised when the client went away
            channel.send({"type": "tokens", "ids": batch.ids, "text": delta}, slot=slot)
            return matcher.finished

        started = time.perf_counter()
        speculate(
            prepared,
            prompt_ids=job["prompt_ids"],
            max_tokens=job["max_tokens"],
            k=0 if settings.PROD_PLAIN else job["k"],  # ACE_PROD_PLAIN: the same path at K = 0 (benchmarks)
            emit=emit,
            sampling=job.get("sampling"),
            stop=rule,
        )
        elapsed = time.perf_counter() - started
        tok_s = stats.output_tokens / elapsed if elapsed > 0 else None
        record = {
            **stats.as_record(),
            "tok_s": tok_s,
            "baseline_tok_s": base,
            "multiplier": tok_s / base if tok_s and base else None,
        }
        tail = matcher.finish()  # the held-back text; "length" when the loop ended at the context
        channel.send(
            {
                "type": "done",
                "finish_reason": matcher.finish_reason,
                "stop_reason": matcher.stop_reason,
                "text": tail,
                "stats": record,
            },
            release=slot,
        )
    except Cancelled:
        logger.info("prod generation %s cancelled after %d tokens", job["request_id"], stats.output_tokens)
        channel.send({"type": "cancelled", "tokens": stats.output_tokens}, release=slot)
    except PathUnavailable as exc:
        channel.send({"type": "error", "reason": str(exc)}, release=slot)
    except Exception as exc:  # noqa: BLE001 - the gateway falls back; the reason says what broke
        logger.exception("prod generation %s failed", job.get("request_id"))
        channel.send({"type": "error", "reason": f"speculative path failed: {type(exc).__name__}: {exc}"}, release=slot)
    finally:
        slot.release()
        client.close()
