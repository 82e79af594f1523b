"""Watch vLLM's EngineCore and Worker processes; when the engine core uses > 0.8 core for 2 s in a row, dump both
with py-spy (`pip install py-spy`; not a dependency of ACE), at most LIMIT times.

    python scripts/diag/vllm_spy_watch.py OUT.txt [LIMIT] &   # then load vLLM, e.g. scripts/diag/vllm_rounds.py
"""

import os
import shutil
import subprocess
import sys
import time

HZ = os.sysconf("SC_CLK_TCK")
out = sys.argv[1]
limit = int(sys.argv[2]) if len(sys.argv) > 2 else 3


def find():
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            comm = open(f"/proc/{pid}/comm").read().strip()
        except OSError:
            continue
        if comm.startswith("VLLM::EngineCor"):
            procs["engine"] = pid
        if comm.startswith("VLLM::Worker"):
            procs["worker"] = pid
    return procs


def ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])


dumps = 0
hot = 0
prev = None
while dumps < limit:
    time.sleep(0.5)
    p = find()
    if "engine" not in p:
        prev = None
        continue
    try:
        t = ticks(p["engine"])
    except OSError:
        continue
    if prev is not None and prev[0] == p["engine"]:
        rate = (t - prev[1]) / HZ / 0.5
        hot = hot + 1 if rate > 0.8 else 0
        if hot >= 4:
            with open(out, "a") as f:
                f.write(f"=== {time.strftime('%H:%M:%S')} engine {rate:.2f}\n")
                for name, pid in p.items():
                    f.write(f"--- {name} {pid}\n")
                    f.write(
                        subprocess.run(
                            [shutil.which("py-spy") or "py-spy", "dump", "--pid", pid, "--native"],
                            capture_output=True,
                            text=True,
                        ).stdout[-6000:]
                    )
            dumps += 1
            hot = -10
    prev = (p["engine"], t)
