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
    measure_shadow(
        endpoint_id=endpoint.pk,
        request_id="r-sampled",
        prompt_ids=prompt,
        output_ids=output,
        finish_reason="length",
        max_tokens=len(output),
        temperature=TEMPERATURE,
        top_p=TOP_P,
        top_k=0,
        latency_ms=100.0,
    )
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
    assert record.mean_accepted_len == pytest.approx((1 - expected**4) / (1 - expected), abs=1e-3)
