"""``python -m speculation.bench.families``: every model family the engine runs, against transformers, on one CPU.

For each family (engine/families.py) a small random checkpoint is written by transformers' own config class and
``save_pretrained`` (so tensor names and config keys are a real checkpoint's), then, in this process:

- ``exact``: ACE's greedy tokens equal transformers' ``generate`` on every prompt, and speculative decoding's equal
  ACE's plain ones;
- ``ace_over_transformers``: ACE's plain decoding tok/s over transformers' plain greedy ``generate`` (its default
  attention, one torch thread, the same checkpoint and prompts);
- ``speculative_over_plain``: ACE with a one-layer draft of the same family (the target's first layer, embedding,
  final norm and head: the target's later layers are scaled down so that the draft agrees often) over ACE plain.

Prints a table and writes JSON (``--json PATH``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from speculation.engine import DraftModelProposer, GenerationConfig, LocalTarget, generate, load_causal_lm

# family -> (transformers config class, what the family's real checkpoints set beyond the shape)
FAMILY_CONFIGS: dict[str, tuple[str, dict]] = {
    "llama3": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),  # fmt: skip
    "mistral": ("MistralConfig", {"sliding_window": 48}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 64}),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": 48,
            "query_pre_attn_scalar": 32,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "alternate": True,
        },
    ),  # fmt: skip
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 48, "alternate": True, "tie_word_embeddings": False}),
    "phi3": ("Phi3Config", {"partial_rotary_factor": 0.5, "pad_token_id": 0, "eos_token_id": 2}),
}
SHAPE = {
    **{"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4},
    **{"num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "max_position_embeddings": 512},
}
K = 4


def build_checkpoint(
    directory: Path, class_name: str, extra: dict, shape: dict, *, seed: int, shard: str | None = None,
    quiet_layers: float = 1.0,
) -> torch.nn.Module:  # fmt: skip
    """A random checkpoint of the family written to ``directory`` (shards of at most ``shard`` when given); returns
    transformers' model of it. ``extra["alternate"]``: sliding and full layers alternate (Gemma). Logit-scale weights
    are wide so that top-2 logits are far apart (no near-ties); layers after the first have their outputs scaled by
    ``quiet_layers``."""
    import transformers

    extra = dict(extra)
    if extra.pop("alternate", False):
        extra["layer_types"] = ["sliding_attention", "full_attention"] * (shape["num_hidden_layers"] // 2 + 1)
        extra["layer_types"] = extra["layer_types"][: shape["num_hidden_layers"]]
    config = getattr(transformers, class_name)(**{**shape, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            wide = id(param) in embeddings
            param.copy_(
                torch.randn_like(param) * (2.0 if wide else 0.3 if "norm" in name or param.dim() == 1 else 0.12)
            )
            if (
                quiet_layers != 1.0
                and ".layers.0." not in name
                and name.endswith(("o_proj.weight", "down_proj.weight"))
            ):
                param.mul_(quiet_layers)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory, **({"max_shard_size": shard} if shard else {}))
    return model


def first_layer_draft(target_dir: Path, directory: Path) -> None:
    """A one-layer checkpoint of the target's own first layer, embedding, final norm and head (same family)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir)
    config = model.config
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    draft = transformers.AutoModelForCausalLM.from_config(config)
    draft.load_state_dict(model.state_dict(), strict=False)
    draft.save_pretrained(directory)


def time_it(run) -> tuple[float, object]:
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def bench_family(name: str, root: Path, prompts: list[list[int]], max_new: int) -> dict:
    class_name, extra = FAMILY_CONFIGS[name]
    target_dir, draft_dir = root / f"{name}-target", root / f"{name}-draft"
    hf = build_checkpoint(target_dir, class_name, extra, SHAPE, seed=0, shard="2MB", quiet_layers=0.1)
    first_layer_draft(target_dir, draft_dir)
    target_model = load_causal_lm(target_dir)
    target = LocalTarget(target_model)
    draft = load_causal_lm(draft_dir)
    config = GenerationConfig(max_new_tokens=max_new, k=K)

    def hf_all():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False)[0, len(p) :].tolist()
                for p in prompts]  # fmt: skip

    def ace_all():
        return [generate(target, None, p, config).tokens for p in prompts]

    def spec_all():
        runs = [generate(target, DraftModelProposer(draft, target_vocab_size=SHAPE["vocab_size"]), p, config)
                for p in prompts]  # fmt: skip
        return [r.tokens for r in runs], sum(r.stats.accepted_tokens for r in runs) / sum(
            max(r.stats.drafted_tokens, 1) for r in runs
        )

    with torch.inference_mode():
        hf.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        generate(target, None, prompts[0], GenerationConfig(max_new_tokens=4))
        hf_s, hf_tokens = time_it(hf_all)
        ace_s, ace_tokens = time_it(ace_all)
        spec_s, (spec_tokens, acceptance) = time_it(spec_all)
    tokens = len(prompts) * max_new
    return {
        "exact": ace_tokens == hf_tokens and spec_tokens == ace_tokens,
        "ace_over_transformers": round(hf_s / ace_s, 2),
        "speculative_over_plain": round(ace_s / spec_s, 2),
        "ace_tok_s": round(tokens / ace_s, 1),
        "transformers_tok_s": round(tokens / hf_s, 1),
        "speculative_tok_s": round(tokens / spec_s, 1),
        "acceptance": round(acceptance, 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speculation.bench.families", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: best on a shared CPU)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per family (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--family", action="append", choices=list(FAMILY_CONFIGS), help="only these (repeatable)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or args.threads < 1:
        print("--prompts, --max-new-tokens and --threads must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (8 + 4 * i,), generator=generator).tolist()
               for i in range(args.prompts)]  # fmt: skip
    results: dict[str, dict] = {}
    print(f"{'family':8} {'exact':>5} {'ace/hf':>7} {'spec/plain':>10} {'ace tok/s':>9} {'hf tok/s':>8} {'accept':>6}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.family or FAMILY_CONFIGS:
            row = results[name] = bench_family(name, Path(tmp), prompts, args.max_new_tokens)
            print(f"{name:8} {str(row['exact']):>5} {row['ace_over_transformers']:>7} "
                  f"{row['speculative_over_plain']:>10} {row['ace_tok_s']:>9} {row['transformers_tok_s']:>8} "
                  f"{row['acceptance']:>6}", flush=True)  # fmt: skip
    report = {
        "command": "python -m speculation.bench.families " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {args.threads}",
        "load_avg": os.getloadavg(),
        "shape": SHAPE,
        "k": K,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
