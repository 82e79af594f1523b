"""Torch on a CPU in a second thread, and with OpenMP's wait policies: why a batching worker keeps one team.

    OMP_WAIT_POLICY=PASSIVE python scripts/diag/openmp_teams.py     # or GOMP_SPINCOUNT=10000, or nothing

1. A linear layer of the demo target's width over 8 rows (torch threads 2), timed in the main thread, then in a
   second thread after the main thread ran a 2-thread region, then in a second thread of a process whose main thread
   only ever ran torch with one thread (speculation.worker.openmp's arrangement).
2. The demo pair's BatchDecoder (1 request at K = 5, 8 at K = 0 and at K = 5, 64 new tokens, prefill included) in a
   thread of a process whose main thread first ran the target with 2 threads, and again with the main thread at 1.
Prints microseconds per call and tok/s; each case runs in a fresh interpreter (a process's OpenMP teams are its own).
"""

from __future__ import annotations

import os
import subprocess
import sys

CASE = r"""
import os, sys, threading, time, torch
case = sys.argv[1]
if case.endswith("main1"):
    torch.set_num_threads(1)
lin = torch.nn.Linear(384, 1024, bias=False); x = torch.randn(8, 384)

def linear():
    with torch.inference_mode():
        for _ in range(300): lin(x)
        best = min(_timed() for _ in range(5))
    return f"{best:.1f} us per call"

def _timed():
    t = time.perf_counter()
    for _ in range(2000): lin(x)
    return (time.perf_counter() - t) / 2000 * 1e6

def decoder():
    from tokenizers import Tokenizer
    from speculation.bench.engine import DEFAULT_QUESTIONS, load_prompts
    from speculation.engine import BatchDecoder, GenerationConfig, load_causal_lm
    from speculation.offline.demo import ensure_demo_pair
    pair = ensure_demo_pair()
    tok = Tokenizer.from_file(str(pair.target_dir / "tokenizer.json"))
    prompts = [p.ids for p in load_prompts(tok, DEFAULT_QUESTIONS, per_category=3, code_prompts=6)]
    target, draft = (load_causal_lm(d, max_len=1024) for d in (pair.target_dir, pair.draft_dir))
    with torch.inference_mode():
        target(torch.tensor(prompts[3]), 0)  # the main thread runs torch (at its thread count) first
    out = []
    def run():
        torch.get_num_threads(); torch.set_num_threads(2)
        for n, k in ((1, 5), (8, 0), (8, 5)):
            dec = BatchDecoder(target, slots=n, draft=draft if k else None)
            t = time.perf_counter()
            for i in range(n): dec.add(i, prompts[i], GenerationConfig(max_new_tokens=64, k=k or 5))
            tokens = 0
            while len(dec): tokens += sum(len(u.tokens) for u in dec.step())
            out.append(f"{n} x K={k}: {tokens / (time.perf_counter() - t):.0f} tok/s")
    th = threading.Thread(target=run); th.start(); th.join()
    return ", ".join(out)

if case.startswith("linear"):
    if case == "linear-main":
        torch.set_num_threads(2); print(case, linear())
    else:
        torch.set_num_threads(1 if case.endswith("main1") else 2); linear()  # the main thread's region
        res = []
        def second():
            torch.get_num_threads(); torch.set_num_threads(2); res.append(linear())
        th = threading.Thread(target=second); th.start(); th.join()
        print(case, res[0])
else:
    torch.set_num_threads(1 if case.endswith("main1") else 2)
    print(case, decoder())
"""


def main() -> int:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    print(
        "OMP_WAIT_POLICY",
        os.environ.get("OMP_WAIT_POLICY", "unset"),
        "GOMP_SPINCOUNT",
        os.environ.get("GOMP_SPINCOUNT", "unset"),
    )
    for case in (
        "linear-main",
        "linear-thread-after-main2",
        "linear-thread-main1",
        "decoder-thread-after-main2",
        "decoder-thread-main1",
    ):
        done = subprocess.run([sys.executable, "-c", CASE, case], env=env, capture_output=True, text=True)
        print(done.stdout.strip() or done.stderr[-500:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
