"""Reproduce, straight against vLLM (no ACE), the greedy outputs its speculation changes in mixed batches.

For plain, n-gram (K=3) and the demo draft model (K=3): two greedy completions alone, then four greedy and four
temperature 0.7 completions at once; prints the greedy texts. Plain gives one text everywhere; with speculation
(vLLM 0.32, CPU build) the greedy texts batched with sampled requests differ. Then the managed switch canary
(fleet.managed.canary, the reference taken from the same server alone) on that server: its verdict and seconds.
Run from the repository root:

    $ACE_HOME/venv/bin/python scripts/repro_vllm_mixed_batch.py [plain] [ngram] [draft]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

from ace import processes  # noqa: E402
from fleet.managed import canary  # noqa: E402
from speculation.offline.demo import ensure_demo_pair  # noqa: E402

PROMPT = "for i in range(10):\n    print(i)\nfor i in range(10):\n"


def main(which: list[str]) -> None:
    pair = ensure_demo_pair()
    configs = {
        "plain": None,
        "ngram": processes.NGRAM_SPECULATIVE_CONFIG,
        "draft": {"method": "draft_model", "model": str(pair.draft_dir), "num_speculative_tokens": 3},
    }
    log_dir = Path(tempfile.mkdtemp(prefix="ace-repro-"))
    for name in which or list(configs):
        proc = processes.start_vllm(
            model_dir=pair.target_dir, log_dir=log_dir, served_model_name="m", speculative_config=configs[name]
        )
        try:

            def one(temperature: float, url: str = proc.url) -> str:
                body = {"model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": temperature}
                return httpx.post(url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]

            alone = [one(0.0) for _ in range(2)]
            with ThreadPoolExecutor(8) as pool:
                mixed = list(pool.map(one, [0.0, 0.7] * 4))
            print(name, json.dumps({"greedy_alone": alone, "greedy_in_mixed_batch": mixed[0::2]}), flush=True)
            print(name, "switch canary:", json.dumps(canary.run(new_url=proc.url, model="m", old_url=None).record()))
        finally:
            proc.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
