"""CPU per process group, every second, as JSON lines: what ran while a benchmark round was slow.

    python scripts/diag/cpu_sample.py OUT.jsonl &   # then run the benchmark; kill it afterwards

Groups by command line: vLLM's processes by name (VLLM::EngineCore, VLLM::Worker, its API server `python`), the
Celery worker, ACE's web process, Redis, the bench client, the rest by name. Reads /proc only (Linux).
"""

from __future__ import annotations

import json
import os
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")


def _group(comm: str, cmd: str) -> str:
    if "vllm" in cmd or comm.startswith("VLLM") or "EngineCore" in comm:
        return "vllm:" + comm[:12]
    for needle, name in (("celery", "worker"), ("uvicorn", "ace-web"), ("redis", "redis"), ("bench_gateway", "bench")):
        if needle in cmd:
            return name
    return "other:" + comm[:15]


def ticks() -> dict[tuple[str, str], int]:
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        comm = stat.split("(", 1)[1].rsplit(")", 1)[0]
        out[(pid, _group(comm, cmd))] = int(fields[11]) + int(fields[12])
    return out


def main(path: str) -> None:
    before = ticks()
    with open(path, "w") as out:
        while True:
            time.sleep(1.0)
            now, cores = ticks(), {}
            for key, used in now.items():
                if used - before.get(key, used):
                    cores[key[1]] = cores.get(key[1], 0.0) + (used - before.get(key, used)) / HZ
            before = now
            busy = {k: round(v, 2) for k, v in sorted(cores.items(), key=lambda kv: -kv[1]) if v >= 0.03}
            out.write(json.dumps({"ts": time.strftime("%H:%M:%S", time.gmtime()), **busy}) + "\n")
            out.flush()


if __name__ == "__main__":
    main(sys.argv[1])
