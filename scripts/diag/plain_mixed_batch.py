"""A plain vLLM (the demo target, no speculation, no ACE) under 4 greedy + 4 temperature 0.7 streaming clients for
DURATION seconds: how many greedy texts differ from the one it gives alone (the managed switch test's question).

    DURATION=300 $ACE_HOME/venv/bin/python scripts/diag/plain_mixed_batch.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

from ace import processes  # noqa: E402
from speculation.offline.demo import ensure_demo_pair  # noqa: E402

PROMPT = "for i in range(10):\n    print(i)\nfor i in range(10):\n"
DURATION = float(os.environ.get("DURATION", "240"))


def stream(client: httpx.Client, url: str, temperature: float) -> tuple[str, str | None, int | None]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": temperature, "stream": True}
    text, finish, tokens = "", None, None
    with client.stream("POST", url, json={**body, "stream_options": {"include_usage": True}}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices") or []:
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return text, finish, tokens


def main() -> None:
    pair = ensure_demo_pair()
    proc = processes.start_vllm(model_dir=pair.target_dir, log_dir=Path(tempfile.mkdtemp()), served_model_name="m")
    try:
        url = proc.url + "/v1/completions"
        body = {"model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
        reference = httpx.post(url, json=body, timeout=300).json()["choices"][0]["text"]
        greedy: list[tuple[str, str | None, int | None]] = []
        stop = time.time() + DURATION

        def client(temperature: float) -> None:
            with httpx.Client(timeout=300) as http:
                while time.time() < stop:
                    result = stream(http, url, temperature)
                    if temperature == 0:
                        greedy.append(result)

        threads = [threading.Thread(target=client, args=(0.0 if i % 2 == 0 else 0.7,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        differing = [g for g in greedy if g[0] != reference]
        examples = Counter(map(str, differing)).most_common(5)
        print(
            json.dumps(
                {"reference": reference, "greedy": len(greedy), "differing": len(differing), "examples": examples}
            )
        )
    finally:
        proc.stop()


if __name__ == "__main__":
    main()
