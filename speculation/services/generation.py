"""Prod generation in the GPU worker: draft + verify on the chosen path, tokens streamed through Redis."""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import redis
from django.conf import settings

from fleet.models import Endpoint
from speculation.channel import WorkerChannel
from speculation.models import Mechanism, SpeculationPolicy, VerificationPath
from speculation.paths import SpecRunStats, resources
from speculation.paths.drafting import GreedyDraft, NgramDraft
from speculation.paths.local import LocalGreedyVerifier
from speculation.paths.loop import greedy_speculate
from speculation.paths.remote import RemoteGreedyVerifier
from speculation.paths.text import IncrementalText, eos_token_ids
from speculation.services import baseline

logger = logging.getLogger(__name__)

_http: httpx.Client | None = None


def http() -> httpx.Client:
    global _http
    if _http is None:
        _http = httpx.Client(limits=httpx.Limits(max_connections=64, max_keepalive_connections=16))
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


def build(endpoint: Endpoint, policy: SpeculationPolicy, path: str):
    """(proposer, verifier, tokenizer, eos ids) for this policy on this worker."""
    if policy.mechanism == Mechanism.NGRAM:
        proposer: Any = NgramDraft()
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
        proposer = GreedyDraft(draft.model)
        tok, eos = draft.tokenizer, draft.eos_ids
    if path == VerificationPath.REMOTE:
        verifier: Any = RemoteGreedyVerifier(
            client=http(), base_url=endpoint.base_url, model=endpoint.served_model, headers=_headers(endpoint)
        )
    elif path == VerificationPath.LOCAL:
        if not policy.target_path:
            raise PathUnavailable("path local needs the policy's target_path")
        verifier = LocalGreedyVerifier(resources.model(policy.target_path).model)
    else:
        raise PathUnavailable(f"path {path!r} does not run in the worker")
    return proposer, verifier, tok, eos


def run_prod_generation(job: dict[str, Any]) -> None:
    """Generate one prod request; every outcome ends with a done or error message on the channel."""
    client = redis_client()
    channel = WorkerChannel(client, job["request_id"])
    try:
        endpoint = Endpoint.objects.get(pk=job["endpoint_id"])
        policy = SpeculationPolicy.objects.select_related("draft").get(endpoint=endpoint)
        proposer, verifier, tok, eos = build(endpoint, policy, job["path"])
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
        text = IncrementalText(tok)
        stats = SpecRunStats(k=job["k"])
        finished = False
        started = time.perf_counter()
        for batch in greedy_speculate(
            proposer=proposer,
            verifier=verifier,
            prompt_ids=job["prompt_ids"],
            max_tokens=job["max_tokens"],
            k=job["k"],
            eos_ids=eos,
        ):
            stats.add(batch)
            finished = batch.finished
            channel.send({"type": "tokens", "ids": batch.ids, "text": text.add(batch.ids)})
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
