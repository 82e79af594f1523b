"""The engine's leaner forward: the same numbers by fewer operations.

Exact (no tolerance): RoPE by a roll with a signed sine table is Hugging Face's rotate-half form bitwise;
column-major storage keeps every weight's values and the embedding tie. Within float32 rounding (atol 1e-5 on
logits of size ~10; a different summation order is all that changes): one row through BatchedModel's one-row way
equals that row inside a batch and the batch-1 Transformer, and a loaded model's logits equal those of the
row-major weights.
"""

from __future__ import annotations

import pytest
import torch

from speculation.engine import load_causal_lm
from speculation.engine.batch_model import BatchedModel
from speculation.engine.loader import column_major_linears
from speculation.engine.rope import apply_rope, rope_tables
from tests.support.models import tiny_model

ATOL = 1e-5


def test_rope_by_a_roll_is_the_rotate_half_form_bitwise(target_model):
    cos, signed = rope_tables(target_model.args, torch.device("cpu"))
    half = target_model.args.head_dim // 2
    sin = torch.cat([-signed[:, :half], signed[:, half:]], dim=-1)  # the plain sine table
    x = torch.randn(2, 6, 9, target_model.args.head_dim)  # [B, H, T, D]
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # Hugging Face's rotate_half
    expected = x * cos[40:49] + rotated * sin[40:49]
    assert torch.equal(apply_rope(x, cos[40:49], signed[40:49]), expected)
    assert not torch.allclose(apply_rope(x, cos[40:49], sin[40:49]), expected)  # an unsigned table rotates wrong


@pytest.mark.parametrize("width", [1, 4])
def test_one_row_equals_that_row_in_a_batch_and_the_batch1_model(target_model, width):
    prompts = [torch.arange(3, 3 + n) % target_model.vocab_size for n in (11, 7, 15)]
    alone = BatchedModel(target_model, max_rows=1)
    batch = BatchedModel(target_model, max_rows=3)
    alone.reserve(1, 64)
    batch.reserve(3, 64)
    with torch.inference_mode():
        alone.forward(prompts[0][None], [0])
        for row, prompt in enumerate(prompts):
            batch.forward(prompt[None], [0], first_row=row)  # rows 1, 2: other requests at other lengths
        new = torch.tensor([[5, 9, 2, 30][:width]] * 3)
        starts = [11, 7, 15]
        in_batch = batch.forward(new, starts)[0]  # [T, V]
        one_row = alone.forward(new[:1], [11])[0]
        target_model.forward(prompts[0], 0)
        batch1 = target_model.forward(new[0], 11).logits
    assert one_row.shape == in_batch.shape == batch1.shape == (width, target_model.vocab_size)
    torch.testing.assert_close(one_row, in_batch, atol=ATOL, rtol=0)
    torch.testing.assert_close(one_row, batch1, atol=ATOL, rtol=0)
    assert torch.equal(one_row.argmax(-1), batch1.argmax(-1))


def test_column_major_keeps_values_and_ties():
    model = tiny_model(seed=3)
    before = {name: p.clone() for name, p in model.named_parameters()}
    ids = torch.tensor([1, 4, 9, 16, 25, 36])
    with torch.inference_mode():
        expected = model.forward(ids, 0).logits
    column_major_linears(model)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    wqkv = model.layers[0].attention.wqkv.weight
    assert wqkv.stride() == (1, wqkv.shape[0])  # [out, in] seen over an [in, out] buffer
    assert model.tok_embeddings.weight.is_contiguous()
    with torch.inference_mode():
        torch.testing.assert_close(model.forward(ids, 0).logits, expected, atol=ATOL, rtol=0)

    tied = tiny_model(seed=4)
    tied.output.weight = tied.tok_embeddings.weight
    column_major_linears(tied)
    assert tied.output.weight is tied.tok_embeddings.weight and tied.output.weight.is_contiguous()


def test_a_model_loaded_on_cpu_is_column_major_and_answers_as_hugging_face(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    engine = load_causal_lm(tiny_model_dir, max_len=64)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    w2 = engine.layers[1].feed_forward.w2.weight
    assert w2.stride() == (1, w2.shape[0])
    ids = torch.tensor([1, 5, 6, 7, 9, 12, 3])
    with torch.inference_mode():
        ours = engine(ids, 0).logits
        theirs = hf(ids[None]).logits[0]
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
