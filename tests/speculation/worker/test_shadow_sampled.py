"""Shadow on sampled traffic when the worker holds the target: the recorded acceptance is exactly the mean over
output positions of sum_x min(p(x), q(x)), p and q processed as the request asked.

The reference here is computed independently of the worker's code: logits from transformers' own Llama, and
temperature / top-p written out by hand. Tolerance 1e-4 (float32 logits from two implementations).
"""

from __future__ import annotations

import pytest
import torch

from speculation.worker.shadow import measure_shadow

TEMPERATURE, TOP_P = 0.7, 0.9


def _processed(logits: torch.Tensor) -> torch.Tensor:
    """Temperature, then top-p (keep a token while the mass ranked before it is below top_p), by hand."""
    probs = torch.softmax(logits.double() / TEMPERATURE, -1)
    out = torch.zeros_like(probs)
    for row, dist in enumerate(probs):
        mass = 0.0
        for token in dist.argsort(descending=True).tolist():
            if mass >= TOP_P:
                break
            out[row, token] = dist[token]
            mass += float(dist[token])
    return out / out.sum(-1, keepdim=True)


def _logits(model_dir, tokens: list[int]) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.django_db
def test_sampled_shadow_with_the_target_in_the_worker_records_the_exact_acceptance(tiny_model_dir, other_model_dir):
    from fleet.models import Endpoint
    from speculation.models import DraftModel, SpeculationPolicy, StageRecord

    # given a policy whose draft and target both live in the worker
    endpoint = Endpoint.objects.create(name="tiny-shadow", base_url="http://127.0.0.1:9", node_class="cpu")
    draft = DraftModel.objects.create(name="tiny-draft", kind="draft_model", path=str(tiny_model_dir))
    SpeculationPolicy.objects.update_or_create(
        endpoint=endpoint,
        defaults={
            "mode": "shadow",
            "mechanism": "draft_model",
            "draft": draft,
            "k": 3,
            "target_path": str(other_model_dir),
        },
    )
    prompt, output = [1, 5, 9, 14], [20, 31, 7, 7, 42, 100, 3, 250]
    # when
    _shadow(endpoint, "r-sampled", prompt, output)
    # then: alpha = mean_i sum_x min(p_i, q_i) over the output positions
    tokens = prompt + output[:-1]
    positions = slice(len(prompt) - 1, None)
    p = _processed(_logits(other_model_dir, tokens)[positions])
    q = _processed(_logits(tiny_model_dir, tokens)[positions])
    expected = torch.minimum(p, q).sum(-1).mean().item()
    record = StageRecord.objects.get(request_id="r-sampled")
    assert record.action == "would_speculate"
    assert record.alpha == pytest.approx(expected, abs=1e-4)
    assert 0.05 < expected < 0.95  # a case where the value is informative (neither agreement nor disjoint)
    assert record.unseen_mass is None and "exact" in record.reason
    # and its mean accepted length is the expected replay's at K = 3, the draft passing at each position with
    # min(1, q(o) / p(o)) for the sampled token o (not the i.i.d. formula over the mean alpha, which overstates it)
    from speculation.engine import expected_hybrid

    # (this output is not a sample of the target: where top-p cut its token, p(o) = 0, the average stands in)
    rows, out = torch.arange(len(output)), torch.tensor(output)
    p_o, q_o = p[rows, out], q[rows, out]
    average = torch.minimum(p, q).sum(-1)
    passes = torch.where(p_o > 0, torch.clamp(q_o / p_o.clamp(min=1e-30), max=1.0), average).tolist()
    assert (p_o > 0).any() and (p_o == 0).any()
    sequence = prompt + output
    want = expected_hybrid(
        None, passes, sequence, 3, prompt_len=len(prompt), lookup_k=3, min_lookup=3, max_new_tokens=len(output)
    )
    assert record.mean_accepted_len == pytest.approx(want.mean_accepted_len, abs=1e-3)
    assert abs(want.mean_accepted_len - (1 - expected**4) / (1 - expected)) > 0.01  # the two differ here


def _policy(mechanism: str, draft_dir, target_dir):
    from fleet.models import Endpoint
    from speculation.models import DraftModel, SpeculationPolicy

    endpoint = Endpoint.objects.create(name=f"tiny-{mechanism}", base_url="http://127.0.0.1:9", node_class="cpu")
    draft = DraftModel.objects.create(name="tiny-draft", kind="draft_model", path=str(draft_dir))
    SpeculationPolicy.objects.update_or_create(
        endpoint=endpoint,
        defaults={"mode": "shadow", "mechanism": mechanism, "draft": draft, "k": 3, "target_path": str(target_dir)},
    )
    return endpoint


def _shadow(endpoint, request_id: str, prompt: list[int], output: list[int]) -> None:
    measure_shadow(
        endpoint_id=endpoint.pk,
        request_id=request_id,
        prompt_ids=prompt,
        output_ids=output,
        finish_reason="length",
        max_tokens=len(output),
        temperature=TEMPERATURE,
        top_p=TOP_P,
        top_k=0,
        latency_ms=100.0,
    )


PROMPT, OUTPUT = [5, 6, 7, 8, 5, 6, 7, 9, 10, 11], [8, 5, 6, 7, 9, 10, 11, 8, 5, 6, 7, 12, 13]


@pytest.mark.django_db
def test_sampled_shadow_of_suffix_decoding_replays_it_against_the_sampled_output(
    redis_server, tiny_model_dir, other_model_dir
):
    from speculation.engine import SuffixIndex, SuffixProposer
    from speculation.engine.replay import replay_proposals
    from speculation.models import StageRecord
    from speculation.worker import suffix_store

    # given: suffix decoding in shadow, one earlier answer in the endpoint's store
    endpoint = _policy("suffix", tiny_model_dir, other_model_dir)
    suffix_store.forget(endpoint.pk, redis_too=True)
    suffix_store.remember(endpoint.pk, "old-1", [9, 10, 11, 8, 5])
    # when a sampled request is measured
    _shadow(endpoint, "r-suffix", PROMPT, OUTPUT)
    # then: its record has the replay's counts (a one-hot draft passes exactly where the sampled token equals it)
    index = SuffixIndex()
    index.add("old-1", [9, 10, 11, 8, 5])
    sequence = PROMPT + OUTPUT
    want = replay_proposals(
        lambda n, d: SuffixProposer(index).lookup(sequence[:n], d), sequence, 3, prompt_len=len(PROMPT)
    )
    record = StageRecord.objects.get(request_id="r-suffix")
    assert record.action == "would_speculate" and "replayed against the sampled output (exact" in record.reason
    assert (record.drafted_tokens, record.accepted_tokens, record.target_passes) == (
        want.drafted_tokens,
        want.accepted_tokens,
        want.target_passes,
    )
    assert want.accepted_tokens > 0


@pytest.mark.django_db
def test_sampled_shadow_of_the_hybrid_records_its_expected_counts(redis_server, tiny_model_dir, other_model_dir):
    from speculation.engine import HYBRID_LOOKUP_K, HYBRID_MIN_LOOKUP, SuffixIndex, SuffixProposer, expected_hybrid
    from speculation.models import StageRecord
    from speculation.worker import suffix_store

    # given: the hybrid in shadow; the store's answer leaves the first step to the draft model
    endpoint = _policy("suffix_draft", tiny_model_dir, other_model_dir)
    suffix_store.forget(endpoint.pk, redis_too=True)
    suffix_store.remember(endpoint.pk, "old-1", [9, 10, 11, 8, 5])
    # when
    _shadow(endpoint, "r-hybrid", PROMPT, OUTPUT)
    # then: the expected counts, the draft passing at each position with min(1, q(o) / p(o)) for the sampled o
    # (p, q from transformers' own Llama, processed by hand)
    tokens, positions = PROMPT + OUTPUT[:-1], slice(len(PROMPT) - 1, None)
    p = _processed(_logits(other_model_dir, tokens)[positions])
    q = _processed(_logits(tiny_model_dir, tokens)[positions])
    rows, out = torch.arange(len(OUTPUT)), torch.tensor(OUTPUT)
    passes = torch.clamp(q[rows, out] / p[rows, out], max=1.0).tolist()
    index = SuffixIndex()
    index.add("old-1", [9, 10, 11, 8, 5])
    sequence = PROMPT + OUTPUT
    want = expected_hybrid(
        lambda n, d: SuffixProposer(index).lookup(sequence[:n], d),
        passes,
        sequence,
        3,
        prompt_len=len(PROMPT),
        lookup_k=HYBRID_LOOKUP_K,
        min_lookup=HYBRID_MIN_LOOKUP,
        max_new_tokens=len(OUTPUT),
    )
    record = StageRecord.objects.get(request_id="r-hybrid")
    assert "given each sampled token" in record.reason, record.reason
    assert record.target_passes == round(want.target_passes) and record.drafted_tokens == round(want.drafted_tokens)
    assert record.mean_accepted_len == pytest.approx(want.mean_accepted_len, abs=1e-3)
    assert 0 < want.looked_up_tokens < want.drafted_tokens  # both drafters' steps were in the expectation
