"""EAGLE training data for tests: a target's own greedy continuations of random prompts, with its features."""

from __future__ import annotations

import torch

from speculation.engine import GenerationConfig, LocalTarget, Transformer, generate_plain
from speculation.offline.eagle.collect import Sequences


def greedy_sequences(
    model: Transformer, n: int, seed: int, new_tokens: int = 32, layers: tuple[int, ...] = ()
) -> Sequences:
    """n sequences (8 random prompt tokens + the target's greedy continuation) with the features a head reads:
    the final-norm feature, or with ``layers`` those layers' outputs before it (EAGLE-3)."""
    target = LocalTarget(model)
    generator = torch.Generator().manual_seed(seed)
    data = Sequences()
    for _ in range(n):
        prompt = torch.randint(0, model.vocab_size, (8,), generator=generator).tolist()
        tokens = torch.tensor(
            prompt + generate_plain(target, prompt, GenerationConfig(max_new_tokens=new_tokens)).tokens
        )
        with torch.inference_mode():
            features = model(tokens, 0, return_hidden=layers or True).hidden.clone()
        data.tokens.append(tokens)
        data.features.append(features)
        data.prompt_lens.append(len(prompt))
        data.categories.append("random")
    return data


def head_for(model: Transformer, seed: int = 0):
    """An untrained EAGLE-1 head shaped for ``model`` (FFN twice its width), seeded, in eval mode."""
    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights

    a = model.args
    config = EagleConfig(hidden_size=a.dim, intermediate_size=2 * a.dim, num_attention_heads=a.n_heads,
                         num_key_value_heads=a.n_kv_heads, vocab_size=a.vocab_size,
                         max_position_embeddings=a.max_positions)  # fmt: skip
    head = EagleHead(config)
    init_weights(head, torch.Generator().manual_seed(seed))
    return head.eval()


def trained_head(model: Transformer, head, work_dir, *, epochs: int = 5):
    """Train `head` briefly on the target's own greedy continuations (24 sequences, 3 held out), so that its
    drafts are often accepted; one torch thread while training (a module fixture runs before the per-test one)."""
    from speculation.offline.eagle.train import TrainSettings, train_head

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        settings = TrainSettings(epochs=epochs, lr=3e-3, token_weight=1.0, batch_size=4, seed=0)
        train_head(head, model.tok_embeddings.weight, model.output.weight, greedy_sequences(model, 24, 1),
                   greedy_sequences(model, 3, 2), settings, work_dir=work_dir)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return head.eval()
