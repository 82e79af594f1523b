"""Plain vLLM (the demo target, no ACE) at 8 and 32 greedy streams: ROUNDS rounds of 2 x streams requests of 64
tokens each (Spec-Bench prompts), tok/s per round, with vLLM's environment as ace.processes.start_vllm gives it
(ACE_VLLM_MULTIPROCESSING: one process on a machine without an NVIDIA device, 1 for vLLM's two; ACE_VLLM_OMP_THREADS:
vLLM's own count by default). Prints one JSON line at the end.

    ROUNDS=8 ACE_VLLM_MULTIPROCESSING=1 ACE_VLLM_OMP_THREADS=1 $ACE_HOME/venv/bin/python scripts/diag/vllm_rounds.py
    STREAM=1 LOADS=1,8,32 ...     # streamed responses; the loads to run
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

from ace import processes  # noqa: E402
from speculation.offline.demo import ensure_demo_pair  # noqa: E402

ROUNDS = int(os.environ.get("ROUNDS", "6"))
STREAM = os.environ.get("STREAM", "") == "1"  # streamed responses (SSE), as ACE's gateway and its clients read them
LOADS = tuple(int(x) for x in os.environ.get("LOADS", "8,32").split(","))


def main() -> None:
    data = ROOT / "speculation" / "bench" / "data" / "spec_bench_questions.jsonl"
    prompts = [json.loads(line)["turns"][0] for line in data.read_text().splitlines()][:64]
    pair = ensure_demo_pair()
    proc = processes.start_vllm(model_dir=pair.target_dir, log_dir=Path(tempfile.mkdtemp()), served_model_name="m")
    out = {"env": processes.vllm_cpu_env(), "rounds": {}}
    try:
        client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=64))

        def one(prompt: str) -> int:
            body = {"model": "m", "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
            if not STREAM:
                return client.post(proc.url + "/v1/completions", json=body).json()["usage"]["completion_tokens"]
            body.update(stream=True, stream_options={"include_usage": True})
            tokens = 0
            with client.stream("POST", proc.url + "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        usage = json.loads(line[6:]).get("usage")
                        tokens = usage["completion_tokens"] if usage else tokens
            return tokens

        one("warm up")
        for streams in LOADS:
            rates = []
            for index in range(ROUNDS):
                batch = [prompts[(index * 2 * streams + i) % len(prompts)] for i in range(2 * streams)]
                started = time.perf_counter()
                with ThreadPoolExecutor(streams) as pool:
                    tokens = sum(pool.map(one, batch))
                rates.append(round(tokens / (time.perf_counter() - started), 1))
            out["rounds"][streams] = rates
            print(streams, rates, flush=True)
    finally:
        proc.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
