"""What a prod request thread's relay costs the batch loop's steps: the demo pair's BatchDecoder steps timed as the
calibration times them (speculation.worker.costs_batch.BatchStepTimer, one torch thread, in a thread of their own),
with and without a StepRelay beside them (each step's tokens through the stop matcher and one Redis round trip,
what speculation.worker.generation.TokenStream does per step in prod).

    python scripts/diag/relay_gil.py [--redis-url redis://127.0.0.1:6379/0] [--rounds 15]

Prints the median verify(n) per size and draft step per token, alternating without / with the relay twice. Without
a reachable Redis the relay runs the matcher only (its round trip is part of what it costs: run it with one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

import django  # noqa: E402

django.setup()

import redis  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from speculation.engine import load_causal_lm  # noqa: E402
from speculation.offline.demo import ensure_demo_pair  # noqa: E402
from speculation.worker.costs_batch import BatchStepTimer, StepRelay  # noqa: E402

SIZES = (1, 2, 4, 6)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", default=os.environ.get("ACE_REDIS_URL", "redis://127.0.0.1:6379/0"))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pair = ensure_demo_pair()
    tokenizer = AutoTokenizer.from_pretrained(str(pair.target_dir))
    target, draft = (load_causal_lm(str(d), max_len=1024) for d in (pair.target_dir, pair.draft_dir))
    context = tokenizer.encode("Tell me about the history of the city of Rome and its emperors, in detail. " * 4)[:64]
    client = redis.Redis.from_url(args.redis_url, socket_connect_timeout=1, socket_timeout=2)
    try:
        client.ping()
    except (redis.RedisError, OSError) as exc:
        print(f"no Redis at {args.redis_url} ({exc}): the relay runs the matcher only")
        client = None

    def timed(with_relay: bool) -> str:
        out: list[str] = []

        def run() -> None:  # the batch loop's thread: one torch thread, as at load 1
            torch.set_num_threads(1)
            relay = StepRelay(tokenizer, client=client) if with_relay else None
            timer = BatchStepTimer(target, draft=draft, context=context, relay=relay.put if relay else None)
            rounds = [timer.round(SIZES) for _ in range(args.rounds)]
            if relay is not None:
                relay.close()
            verify = {n: statistics.median(r[0][n] for r in rounds if n in r[0]) * 1e3 for n in SIZES}
            step = statistics.median(x for r in rounds for x in r[1]) * 1e3
            shown = ", ".join(f"verify({n}) {ms:.2f}" for n, ms in verify.items())
            out.append(f"{'with' if with_relay else 'without'} the relay: {shown} ms; draft step {step:.2f} ms/token")

        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
        return out[0]

    for with_relay in (False, True, False, True):
        print(timed(with_relay), flush=True)


if __name__ == "__main__":
    main()
