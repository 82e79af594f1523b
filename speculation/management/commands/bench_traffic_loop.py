"""python manage.py bench_traffic_loop [--quick] [--json PATH] [--requests N] [--max-tokens N] [--epochs N]
    [--workloads code,lists] [--single-layer] [--from-scratch] [--no-prod]

The captured-traffic loop on the run command's demo, every process started here and stopped at the end (the
bench stack: redis, the real vLLM serving the demo target, a Celery worker, ACE): capture on (rate 1.0) for the
demo endpoint, a synthetic mix of workloads unlike the shipped head's training data sent through the gateway (off
mode, greedy, each request labelled with its workload), a head trained on the captures by a training run
(`captured:<endpoint>`; continuing from the endpoint's head, the shipped one, in its own format at the warm-start
learning rate; --from-scratch or --single-layer: a new head), and the shipped and
the trained head replayed on the captures the run held out: mean accepted length per workload and `gain` (trained
over shipped). Then, unless --no-prod, the endpoint runs the trained head in shadow and in prod (local path) on
those held-out prompts: `prod_over_shadow` is prod's measured multiplier over shadow's projection (median per
request). The trained head's directory (under the model roots) is removed at the end, with the stack's database.
What is measured and how: speculation.bench.traffic_loop.
"""

from __future__ import annotations

import asyncio
import json
import platform
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from django.core.management.base import BaseCommand, CommandError

from speculation.bench import traffic_loop
from speculation.management.commands.calibrate import positive_int

K = 3  # the shadow/prod policy's K (bench_gateway's); the replay drafts K = 5 as training reports
REPLAY_K = 5
# The endpoint's head: the shipped one the bench stack registers (the run command's demo pairing drafts with it).
WARM_START_HEAD = "demo-eagle"
MEASURE = """
import json, os
from speculation.bench.traffic_loop import measure
print("MEASURED" + json.dumps(measure(**json.loads(os.environ["ACE_BENCH_LOOP"]))))
"""


class Command(BaseCommand):
    help = "Capture a workload mix, train a head on it, compare it with the shipped head (and prod vs shadow)."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--quick", action="store_true", help="fewer requests and epochs (about 10 min, 2 cores)")
        parser.add_argument("--json", dest="json_path", type=Path, help="write the results there as JSON")
        parser.add_argument("--requests", type=positive_int, help="requests per workload (default 64, quick 32)")
        parser.add_argument("--max-tokens", type=positive_int, help="tokens per answer (default 64, quick 48)")
        parser.add_argument("--epochs", type=positive_int, help="training epochs (default 10, quick 8)")
        parser.add_argument("--workloads", default=",".join(traffic_loop.WORKLOADS), help="comma-separated")
        parser.add_argument("--single-layer", action="store_true", help="train a new single-layer head (EAGLE-1)")
        parser.add_argument(
            "--from-scratch", action="store_true", help="train a new head instead of continuing from the shipped one"
        )
        parser.add_argument("--no-prod", action="store_true", help="skip the shadow and prod runs")

    def handle(self, *args: Any, **options: Any) -> None:
        plan = checked_plan(options)
        from speculation.offline.demo import ensure_demo_pair
        from speculation.offline.eagle.demo_head import default_head_dir

        started = time.perf_counter()
        pair = ensure_demo_pair()
        shipped = default_head_dir(pair)
        if not (shipped / "config.json").is_file():
            raise CommandError(f"no shipped EAGLE head for the demo target in {shipped}", returncode=2)
        prompts = traffic_loop.workload_prompts(plan["workloads"], per_workload=plan["requests"])
        from speculation.bench.stack import BenchStack

        stack = BenchStack(target_dir=pair.target_dir, draft_dir=pair.draft_dir, eagle_dir=shipped)
        self.stderr.write(f"starting redis, vLLM, worker, ACE (logs {stack.log_dir})")
        out_dir = Path(tempfile.mkdtemp(prefix="traffic-loop-", dir=shipped.parent))  # under the model roots
        try:
            stack.start()
            result = self._run(stack, prompts, plan, shipped=shipped, out_dir=out_dir)
        finally:
            stack.stop()
            shutil.rmtree(out_dir, ignore_errors=True)
        result["meta"] = {
            "quick": plan["quick"],
            "plan": {k: v if isinstance(v, bool | int | None) else str(v) for k, v in plan.items()},
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - started, 1),
        }
        self.stderr.write(traffic_loop.table(result))
        text = json.dumps(result, indent=2)
        self.stdout.write(text)
        if plan["json_path"]:
            plan["json_path"].write_text(text + "\n")

    def _run(self, stack, prompts: dict[str, list[str]], plan: dict, *, shipped: Path, out_dir: Path) -> dict:
        endpoint = stack.endpoints["demo"]["id"]
        self._capture(stack, endpoint, enabled=True)
        for workload, batch in prompts.items():  # sent in order: the oldest captures of each are held out
            headers = {**stack.headers, "X-ACE-Workload": workload}
            asyncio.run(_send(stack, batch, plan["max_tokens"], headers))
        captured = self._wait_captures(stack, endpoint, sum(len(b) for b in prompts.values()))
        self._capture(stack, endpoint, enabled=False)  # the shadow and prod requests below are not training data
        self.stderr.write(f"captured {captured} requests; training")
        options = traffic_loop.training_options(new_tokens=plan["max_tokens"], multi_layer=plan["multi_layer"])
        spec = {"endpoint_id": endpoint, "target_dir": str(stack.target_dir), "shipped_dir": str(shipped),
                "out_dir": str(out_dir), "epochs": plan["epochs"], "options": options, "k": REPLAY_K,
                "init_from": "" if plan["from_scratch"] else WARM_START_HEAD}  # fmt: skip
        from ace import processes

        text = processes.run_manage("shell", "-c", MEASURE, env={**stack.env, "ACE_BENCH_LOOP": json.dumps(spec)},
                                    timeout_s=1800)  # fmt: skip
        measured = json.loads(text.split("MEASURED", 1)[1])
        self.stderr.write(f"trained: {measured['run']}")
        if plan["no_prod"]:
            return traffic_loop.shape(measured, prod=None, prod_reason="--no-prod")
        if not measured["run"]["draft"]:
            return traffic_loop.shape(measured, prod=None, prod_reason="the run registered no head")
        n_test = measured["held_out_per_workload"]
        held_out = [p for w, batch in prompts.items() for p in batch[: n_test.get(w, 0)]]
        prod = self._shadow_vs_prod(stack, held_out, plan["max_tokens"], draft=measured["run"]["draft"])
        return traffic_loop.shape(measured, prod=prod, prod_reason="no request measured in both shadow and prod")

    @staticmethod
    def _capture(stack, endpoint: int, *, enabled: bool) -> None:
        response = httpx.patch(f"{stack.ace_url}/api/v1/endpoints/{endpoint}/capture/",
                               json={"enabled": enabled, "sample_rate": 1.0},
                               headers={"Authorization": f"Token {stack.token}"}, timeout=30)  # fmt: skip
        if response.status_code != 200:
            raise CommandError(f"capture setting refused: {response.text}")

    @staticmethod
    def _wait_captures(stack, endpoint: int, count: int, timeout_s: float = 60) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            response = httpx.get(f"{stack.ace_url}/api/v1/endpoints/{endpoint}/captures/",
                                 headers={"Authorization": f"Token {stack.token}"}, timeout=30)  # fmt: skip
            response.raise_for_status()
            captured = response.json()["total"]["requests"]
            if captured >= count or time.monotonic() > deadline:
                return captured
            time.sleep(0.5)

    def _shadow_vs_prod(self, stack, prompts: list[str], max_tokens: int, *, draft: str) -> dict:
        """bench_gateway's shadow_vs_prod with the trained head: one warm-up request per mode, left out."""
        from speculation.bench import concurrency as concurrency_bench
        from speculation.management.commands.bench_gateway import Command as Gateway

        stack.set_policy("demo", mode="shadow", mechanism="eagle_head", draft=draft, k=K, shadow_sample_rate=1.0,
                         path="local", target_path=str(stack.target_dir))  # fmt: skip
        records = {}
        for mode in ("shadow", "prod"):
            if mode == "prod":
                stack.set_policy("demo", mode="prod")
            asyncio.run(_send(stack, [prompts[0] + " Answer briefly."], max_tokens, stack.headers))
            seen = {r["id"] for r in Gateway._wait_records(stack, "demo", mode, 1, projected=mode == "shadow")}
            asyncio.run(_send(stack, prompts, max_tokens, stack.headers))
            measured = Gateway._wait_records(stack, "demo", mode, len(seen) + len(prompts), projected=mode == "shadow")
            records[mode] = [r for r in measured if r["id"] not in seen]
        stack.set_policy("demo", mode="off")
        prod = [r for r in records["prod"] if r["path"] == "local"]
        result = concurrency_bench.shadow_vs_prod(records["shadow"], prod)
        self.stderr.write(f"shadow vs prod (local): {result}")
        return result


async def _send(stack, prompts: list[str], max_tokens: int, headers: dict[str, str]) -> None:
    from speculation.bench.load import run_concurrent

    await run_concurrent(stack.ace_url, model="demo", prompts=prompts, max_tokens=max_tokens, concurrency=1,
                         headers=headers)  # fmt: skip


def checked_plan(options: dict[str, Any]) -> dict[str, Any]:
    """The run's sizes from the options (--quick's defaults where not given); exit 2 on an unknown workload."""
    quick = bool(options.get("quick"))
    workloads = tuple(w.strip() for w in (options.get("workloads") or "").split(",") if w.strip())
    unknown = sorted(set(workloads) - set(traffic_loop.WORKLOADS))
    if not workloads or unknown:
        raise CommandError(
            f"--workloads takes some of {', '.join(traffic_loop.WORKLOADS)}, comma-separated, not "
            f"{options.get('workloads')!r}",
            returncode=2,
        )
    return {
        "quick": quick,
        "json_path": options.get("json_path"),
        "workloads": tuple(dict.fromkeys(workloads)),
        "requests": options.get("requests") or (32 if quick else 64),
        "max_tokens": options.get("max_tokens") or (48 if quick else 64),
        "epochs": options.get("epochs") or (8 if quick else 10),
        "multi_layer": not options.get("single_layer"),
        "from_scratch": bool(options.get("from_scratch") or options.get("single_layer")),
        "no_prod": bool(options.get("no_prod")),
    }
