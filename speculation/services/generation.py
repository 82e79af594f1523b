"""Prod generation in the GPU worker: draft + verify on the chosen path, tokens streamed through Redis.

Both paths draft with the engine's proposers (speculation.engine). The local path is the engine's own loop
(`generate` on a LocalTarget); the remote path verifies through the target's scoring API, one call per step
(speculation.paths.loop.greedy_speculate with speculation.paths.remote.RemoteGreedyVerifier).
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

from fleet.models import Endpoint
from fleet.netpolicy import PinnedTransport
from speculation.channel import WorkerChannel
from speculation.engine import (
    DraftModelProposer,
    GenerationConfig,
    LocalTarget,
    NgramProposer,
    Proposal,
    SamplingParams,
    generate,
)
from speculation.models import Mechanism, SpeculationPolicy, VerificationPath
from speculation.paths import CommittedBatch, SpecRunStats, resources
from speculation.paths.drafting import StepProposer
from speculation.paths.loop import greedy_speculate
from speculation.paths.remote import RemoteGreedyVerifier
from speculation.paths.text import IncrementalText, eos_token_ids
from speculation.services import baseline

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
    per-step counts (speculation.paths.base) whichever path ran."""

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
        client=http(), base_url=endpoint.base_url, model=endpoint.served_model, headers=_headers(endpoint)
    )
    return Prepared(proposer=proposer, tokenizer=tok, eos_ids=eos, verifier=verifier)


def speculate(
    prepared: Prepared, *, prompt_ids: list[int], max_tokens: int, k: int, emit: Callable[[CommittedBatch], None]
) -> None:
    """Run the prepared path (greedy, fixed K); emit gets each target verification's committed batch."""
    if prepared.verifier is not None:
        for batch in greedy_speculate(
            proposer=StepProposer(prepared.proposer),
            verifier=prepared.verifier,
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            k=k,
            eos_ids=prepared.eos_ids,
        ):
            emit(batch)
        return
    # The local path is the engine's loop (same draft length rule as greedy_speculate's step_k); each step's
    # tokens come through on_tokens: the accepted drafts + the target's token, cut after a stop token.
    log = StepLog(prepared.proposer)

    def on_tokens(ids: list[int]) -> None:
        accepted, drafted = log.last
        finished = bool(ids) and ids[-1] in prepared.eos_ids
        emit(CommittedBatch(ids=ids, drafted=drafted, accepted=min(accepted, len(ids)), finished=finished))

    config = GenerationConfig(
        max_new_tokens=max_tokens, k=k, temperature=0.0, stop_token_ids=tuple(sorted(prepared.eos_ids))
    )
    generate(prepared.target, log, prompt_ids, config, on_tokens=on_tokens)


def run_prod_generation(job: dict[str, Any]) -> None:
    """Generate one prod request; every outcome ends with a done or error message on the channel."""
    client = redis_client()
    channel = WorkerChannel(client, job["request_id"])
    try:
        endpoint = Endpoint.objects.get(pk=job["endpoint_id"])
        policy = SpeculationPolicy.objects.select_related("draft").get(endpoint=endpoint)
        prepared = build(endpoint, policy, job["path"])
        base = baseline.baseline_tok_s(
            redis_client=client,
            endpoint_id=endpoint.pk,
            measure=lambda: baseline.calibrate(
                client=http(),
                base_url=endpoint.base_url,
                model=endpoint.served_model,
                headers=_headers(endpoint),
                prompt_ids=job["prompt_ids"],
                max_tokens=job["max_tokens"],
            ),
        )
        channel.send({"type": "ready"})  # loaded and calibrated: from here the gateway's step timeout applies
        text = IncrementalText(prepared.tokenizer)
        stats = SpecRunStats(k=job["k"])
        finished = False

        def emit(batch: CommittedBatch) -> None:
            nonlocal finished
            stats.add(batch)
            finished = batch.finished
            channel.send({"type": "tokens", "ids": batch.ids, "text": text.add(batch.ids)})

        started = time.perf_counter()
        speculate(prepared, prompt_ids=job["prompt_ids"], max_tokens=job["max_tokens"], k=job["k"], emit=emit)
        elapsed = time.perf_counter() - started
        tok_s = stats.output_tokens / elapsed if elapsed > 0 else None
        record = {
            **stats.as_record(),
            "tok_s": tok_s,
            "baseline_tok_s": base,
            "multiplier": tok_s / base if tok_s and base else None,
        }
        channel.send({"type": "done", "finish_reason": "stop" if finished else "length", "stats": record})
    except PathUnavailable as exc:
        channel.send({"type": "error", "reason": str(exc)})
    except Exception as exc:  # noqa: BLE001 - the gateway falls back; the reason says what broke
        logger.exception("prod generation %s failed", job.get("request_id"))
        channel.send({"type": "error", "reason": f"speculative path failed: {type(exc).__name__}: {exc}"})
    finally:
        client.close()
