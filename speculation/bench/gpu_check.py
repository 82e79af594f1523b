"""``python -m speculation.bench.gpu_check``: the engine on a CUDA device (scripts/device/engine_gpu.sh runs it).

1. Family exactness, per family of engine/families.py and one that runs through transformers (GPT-NeoX): a small
   random checkpoint written by transformers' own config class (speculation.bench.families), decoded greedily by
   ACE and by transformers' ``generate`` (eager attention) on the device, from the same prompts:
   - float32: tokens identical on every prompt (CUDA float32 matmuls are not TF32 unless asked, so the two differ
     by about 1e-5 while the checkpoints' top-2 gaps are far larger), and speculative decoding identical to plain;
   - the half dtype (``--dtype``, bf16 by default): bf16 keeps 8 significant bits, and the two implementations round
     at different points (fused projections, attention kernels), so where the exact top-2 gap is within their
     rounding either may pick the other token. So each step of transformers' half-precision greedy run is compared
     on the same tokens: ACE's half-precision model is fed them one at a time (as it decodes) and its argmax must be
     transformers' token, except at near-ties. A near-tie is measured, not guessed: transformers' float32 logits
     on the same tokens give the exact top-2 gap, and each half run's largest distance from them its rounding e;
     two runs each within e of the exact logits pick the same token when the gap exceeds 2 x the larger e. At least
     ``MIN_COMPARED`` of the steps must be compared (so that the check is not vacuous).
2. The engine benchmark (``python -m speculation.bench --quick --no-eagle``) with every model on the device.

Prints a summary and JSON (``--json PATH``); exit 0 when every family is exact, 1 when one is not, 2 when the
device asked for is a CUDA one and torch sees none (or on bad arguments).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from speculation.bench.families import FAMILY_CONFIGS, SHAPE, build_checkpoint, first_layer_draft
from speculation.engine import DraftModelProposer, GenerationConfig, LocalTarget, generate, load_causal_lm

GENERIC_CONFIGS = {"gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25})}  # Pythia's family: transformers runs it
MIN_COMPARED = 0.5  # the share of half-precision tokens that must come before a near-tie
# A small vocabulary keeps top-2 gaps wide (the largest of fewer random logits stands further out), and Gemma 2's final
# soft-cap one that the wide random logits do not saturate (at 30 every top logit sits within bf16's rounding of 30).
CHECK_SHAPE = {**SHAPE, "vocab_size": 512}
CHECK_OVERRIDES = {"gemma2": {"final_logit_softcapping": 300.0}}
K = 4


def no_cuda_message(device: str) -> str | None:
    """Why ``device`` cannot be used here (None: it can)."""
    if device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {device}: torch sees no CUDA device on this machine (torch {torch.__version__})"
    return None


@torch.inference_mode()
def half_steps(hf, exact, model, prompt: list[int], max_new: int) -> tuple[int, int]:
    """(steps compared, steps where ACE's ``model`` picks another token than transformers' ``hf``) along hf's greedy
    run, near-ties (measured against the float32 ``exact``) left out."""
    ids = torch.tensor([prompt], device=hf.device)
    out = hf.generate(ids, max_new_tokens=max_new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    sequence = out.sequences[0]
    reference = exact(sequence[None, :-1]).logits[0, len(prompt) - 1 :].float()  # [max_new, V]
    model.setup_cache(model.max_len)
    model(sequence[: len(prompt) - 1], 0)
    compared = differ = 0
    for i, (theirs, exact_logits) in enumerate(zip(out.logits, reference, strict=True)):
        position = len(prompt) - 1 + i
        ours = model(sequence[position : position + 1], position).logits[-1].float()
        rounding = max(float((theirs[0].float() - exact_logits).abs().max()), float((ours - exact_logits).abs().max()))
        top = exact_logits.topk(2).values
        if float(top[0] - top[1]) > 2 * rounding:
            compared += 1
            differ += int(ours.argmax()) != int(sequence[position + 1])
    return compared, differ


def plain_identical(hf, target: LocalTarget, prompt: list[int], max_new: int) -> bool:
    """ACE's greedy decoding gives transformers' greedy tokens."""
    ids = torch.tensor([prompt], device=hf.device)
    reference = hf.generate(ids, max_new_tokens=max_new, do_sample=False)[0, len(prompt) :].tolist()
    return generate(target, None, prompt, GenerationConfig(max_new_tokens=max_new)).tokens == reference


def check_family(
    name: str, root: Path, prompts: list[list[int]], max_new: int, *, device: str, half: torch.dtype
) -> dict:
    """ACE against transformers on the device, in float32 (exact) and in ``half`` (up to near-ties)."""
    import transformers

    class_name, extra = {**FAMILY_CONFIGS, **GENERIC_CONFIGS}[name]
    extra = {**extra, **CHECK_OVERRIDES.get(name, {})}
    target_dir, draft_dir = root / f"{name}-target", root / f"{name}-draft"
    build_checkpoint(target_dir, class_name, extra, CHECK_SHAPE, seed=0, quiet_layers=0.1)
    first_layer_draft(target_dir, draft_dir)

    def reference_model(dtype: torch.dtype):
        hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, attn_implementation="eager")
        return hf.to(device).eval()

    exact = reference_model(torch.float32)
    row: dict = {}
    for dtype in (torch.float32, half):
        model = load_causal_lm(target_dir, device=device, dtype=dtype)
        target = LocalTarget(model)
        draft = DraftModelProposer(
            load_causal_lm(draft_dir, device=device, dtype=dtype), target_vocab_size=model.vocab_size
        )
        config = GenerationConfig(max_new_tokens=max_new, k=K)
        speculative_same = sum(
            generate(target, draft, p, config).tokens == generate(target, None, p, config).tokens for p in prompts
        )
        label = str(dtype).removeprefix("torch.")
        if dtype == torch.float32:
            same = sum(plain_identical(exact, target, p, max_new) for p in prompts)
            entry = {"identical_prompts": same, "identical": same == len(prompts) == speculative_same}
        else:
            hf = reference_model(dtype)
            counts = [half_steps(hf, exact, model, p, max_new) for p in prompts]
            compared, differ = sum(c for c, _ in counts), sum(d for _, d in counts)
            entry = {
                "steps_compared": compared,
                "steps_differing": differ,
                "compared_share": round(compared / (len(prompts) * max_new), 3),
            }
            entry["identical"] = differ == 0 and compared >= MIN_COMPARED * len(prompts) * max_new
        entry["speculative_identical_prompts"] = speculative_same
        row[label] = entry
        row["implementation"] = model.implementation
    row["exact"] = all(v["identical"] for v in row.values() if isinstance(v, dict))
    return row


def run_bench(device: str, dtype: str, out: Path) -> dict:
    from speculation.bench.engine import main as engine_main

    code = engine_main(["--quick", "--no-eagle", "--device", device, "--dtype", dtype, "--json", str(out)])
    return json.loads(out.read_text()) if code == 0 and out.is_file() else {"error": f"exit code {code}"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speculation.bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (to try the check itself)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="the half dtype")
    parser.add_argument("--family", action="append", choices=[*FAMILY_CONFIGS, *GENERIC_CONFIGS], help="only these")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per family (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt (default 32)")
    parser.add_argument("--no-bench", action="store_true", help="the family checks only")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    reason = no_cuda_message(args.device)
    if reason:
        print(reason, file=sys.stderr)
        return 2
    if args.prompts < 1 or args.max_new_tokens < 1:
        print("--prompts and --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, CHECK_SHAPE["vocab_size"], (8 + 4 * i,), generator=generator).tolist()
               for i in range(args.prompts)]  # fmt: skip
    half = getattr(torch, args.dtype)
    families: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.family or [*FAMILY_CONFIGS, *GENERIC_CONFIGS]:
            row = families[name] = check_family(
                name, Path(tmp), prompts, args.max_new_tokens, device=args.device, half=half
            )
            print(f"{name:9} {row['implementation']:8} exact={row['exact']} {json.dumps(row[args.dtype])}", flush=True)
        bench = None if args.no_bench else run_bench(args.device, args.dtype, Path(tmp) / "bench.json")
    report = {
        "command": "python -m speculation.bench.gpu_check " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "families": families,
        "bench": bench,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0 if all(row["exact"] for row in families.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
