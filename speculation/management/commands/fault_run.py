"""python manage.py fault_run [--json PATH] [--lanes 32] [--path local|remote]

ACE's real stack (Redis, the real vLLM serving the demo target, a Celery worker, ACE under uvicorn; started
here, stopped at the end) under `--lanes` concurrent greedy prod streams, while, one after the other: the
worker is SIGKILLed and restarted, Redis is stopped and restarted on its port, and vLLM is SIGKILLed and
restarted on its port. Every request is classified (speculation.bench.faults): correct text (equal to
the off-mode answer), a clear error, or a failure (wrong text, a stream cut without an error, a hang); every
completed request must have its stage record. Counts, the fault timeline and ACE's own /metrics go to the JSON.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand

from ace import processes
from speculation.bench.faults import Load, Outcome, chat_body, one_request, summarize
from speculation.bench.load import FALLBACK_PROMPTS, load_prompts
from speculation.bench.stack import BenchStack

DATASET = Path(settings.BASE_DIR).parent / "shared" / "datasets" / "spec_bench_questions.jsonl"

POLICY = """
import json, os
from django.contrib.auth.models import User
from fleet.models import Endpoint
from speculation.services.policies import update_policy
spec = json.loads(os.environ["ACE_FAULT_POLICY"])
update_policy(endpoint=Endpoint.objects.get(name="demo"), **spec)
print("POLICY ok")
"""

RECORDS = """
import json
from speculation.models import StageRecord
rows = list(StageRecord.objects.filter(endpoint__name="demo").values("request_id", "mode", "action", "reason"))
print("RECORDS" + json.dumps(rows))
"""


class Command(BaseCommand):
    help = "Fault run: concurrent prod streams while the worker, Redis and vLLM are killed and restarted."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--json", dest="json_path", help="write the report there as JSON")
        parser.add_argument("--lanes", type=int, default=32, help="concurrent streams (default 32)")
        parser.add_argument("--path", choices=("local", "remote"), default="local", help="prod verification path")
        parser.add_argument("--max-tokens", type=int, default=32)
        parser.add_argument("--worker-concurrency", type=int, default=4, help="worker processes = prod slots")
        parser.add_argument("--step-timeout", type=float, default=15.0, help="ACE_PROD_STEP_TIMEOUT for the run")
        parser.add_argument("--down-s", type=float, default=10.0, help="how long each component stays down")
        parser.add_argument(
            "--settle-s", type=float, default=30.0, help="steady load before the first and after each fault"
        )

    def handle(self, *args, json_path: str | None, lanes: int, path: str, **opts) -> None:
        from speculation.offline.demo import ensure_demo_pair

        started = time.perf_counter()
        pair = ensure_demo_pair()
        step = opts["step_timeout"]
        stack = BenchStack(
            target_dir=pair.target_dir,
            draft_dir=pair.draft_dir,
            extra_env={"ACE_PROD_STEP_TIMEOUT": str(step), "ACE_PROD_START_TIMEOUT": "5"},
            worker_concurrency=opts["worker_concurrency"],
        )
        self.stderr.write(f"starting redis, vLLM, worker, ACE (logs {stack.log_dir})")
        stack.start()
        try:
            report = self._run(stack, lanes=lanes, path=path, step=step, **opts)
        finally:
            stack.stop()
        report["meta"] = {
            "command": "manage.py fault_run "
            + f"--lanes {lanes} --path {path} --worker-concurrency {opts['worker_concurrency']}",
            "lanes": lanes,
            "path": path,
            "max_tokens": opts["max_tokens"],
            "worker_concurrency": opts["worker_concurrency"],
            "prod_step_timeout_s": step,
            "prod_start_timeout_s": 5.0,
            "machine": f"{platform.machine()} {os.cpu_count()} CPUs {platform.processor() or ''}".strip(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - started, 1),
            "logs": str(stack.log_dir),
        }
        text = json.dumps(report, indent=2)
        self.stdout.write(text)
        if json_path:
            Path(json_path).write_text(text + "\n")

    # --- the run ---------------------------------------------------------------------------------------------

    def _run(self, stack: BenchStack, *, lanes: int, path: str, step: float, **opts) -> dict:
        prompts = [p for _, p in load_prompts(DATASET, per_category=1, max_chars=300)][:8] or FALLBACK_PROMPTS
        url = stack.ace_url + "/v1/chat/completions"
        hang_s = step + 20.0
        expected = self._expected(url, stack, prompts, opts["max_tokens"], hang_s)
        self.stderr.write(f"off answers for {len(prompts)} prompts")
        policy = {"mode": "prod", "mechanism": "draft_model", "draft": "demo-draft", "k": 3, "path": path}
        if path == "local":
            policy["target_path"] = str(stack.target_dir)
        stack._manage("shell", "-c", POLICY, extra_env={"ACE_FAULT_POLICY": json.dumps(policy)})
        self._warm(url, stack, prompts[0], hang_s)
        load = Load(
            url=url,
            model="demo",
            prompts=prompts,
            headers=stack.headers,
            lanes=lanes,
            max_tokens=opts["max_tokens"],
            hang_s=hang_s,
            pause_after_error_s=1.0,
        )
        runner = threading.Thread(target=lambda: asyncio.run(load.run()), name="fault-load", daemon=True)
        began = time.monotonic()
        runner.start()
        events = self._faults(stack, began, down_s=opts["down_s"], settle_s=opts["settle_s"])
        load.stop.set()
        runner.join(timeout=hang_s * 3)
        records = self._records(stack, load.outcomes)
        from speculation.selectors.metrics import reason_class

        summary = summarize(load.outcomes, expected=expected, records=records, events=events, reason_class=reason_class)
        summary["metrics"] = self._metrics(stack)
        summary["events"] = [{"t_s": round(t, 1), "event": name} for t, name in events]
        summary["load_still_running"] = runner.is_alive()
        self.stderr.write(
            f"{summary['requests']} requests: {summary['outcomes']}; completed without record "
            f"{summary['completed_without_record']}; passed {summary['passed']}"
        )
        return summary

    def _expected(self, url: str, stack: BenchStack, prompts: list[str], max_tokens: int, hang_s: float) -> dict:
        """Greedy off-mode answers through ACE, all prompts at once (the reference every prod answer must equal)."""

        async def fetch() -> dict[int, str]:
            async with httpx.AsyncClient(timeout=hang_s + 5) as client:
                answers = await asyncio.gather(
                    *(
                        one_request(
                            client,
                            url,
                            body=_body(prompt, max_tokens),
                            headers=stack.headers,
                            hang_s=hang_s,
                            outcome=Outcome(lane=-1, prompt=index, started_s=0.0),
                        )
                        for index, prompt in enumerate(prompts)
                    )
                )
            for answer in answers:
                if not answer.done:
                    raise RuntimeError(f"off answer for prompt {answer.prompt} failed: {answer.status} {answer.error}")
            return {answer.prompt: answer.text for answer in answers}

        return asyncio.run(fetch())

    def _warm(self, url: str, stack: BenchStack, prompt: str, hang_s: float, timeout_s: float = 300.0) -> None:
        """Until the worker has served a prod request (models loaded), so the run starts from a warm worker."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            outcome = asyncio.run(_single(url, prompt, stack.headers, hang_s))
            rows = self._dump(stack)
            if any(r["request_id"] == outcome.request_id and r["action"] == "speculated" for r in rows):
                self.stderr.write("worker warm (a prod request speculated)")
                return
            time.sleep(1)
        raise RuntimeError("the worker never served a prod request")

    def _faults(self, stack: BenchStack, began: float, *, down_s: float, settle_s: float) -> list[tuple[float, str]]:
        events: list[tuple[float, str]] = []

        def mark(name: str) -> None:
            events.append((time.monotonic() - began, name))
            self.stderr.write(f"[{events[-1][0]:7.1f} s] {name}")

        time.sleep(settle_s)
        # 1. the worker, SIGKILLed (the whole process group: no warm shutdown), then a new one
        mark("worker_sigkill")
        os.killpg(stack.procs["worker"].pid, signal.SIGKILL)
        stack.procs["worker"].popen.wait(timeout=30)
        time.sleep(down_s)
        mark("worker_restart")
        stack.adopt(
            # A log of its own: readiness is read from the log, and the killed worker's says "ready" already.
            "worker",
            processes.start_celery_worker(
                env=stack.env,
                log_dir=stack.log_dir / "restarted",
                queues="control,gpu.cpu",
                concurrency=stack.worker_concurrency,
            ),
        )
        mark("worker_up")
        time.sleep(settle_s)
        # 2. Redis stopped, then started again on its port (no persistence: queues and channels are gone)
        port = stack.procs["redis"].extra["port"]
        mark("redis_stop")
        stack.procs["redis"].stop()
        time.sleep(down_s)
        mark("redis_restart")
        stack.adopt("redis", processes.start_redis(workdir=stack.log_dir / "redis", port=port, log_dir=stack.log_dir))
        mark("redis_up")
        time.sleep(settle_s)
        # 3. vLLM SIGKILLed (engine core too), then started again on its port
        vllm = stack.procs["vllm"]
        mark("vllm_sigkill")
        os.killpg(vllm.pid, signal.SIGKILL)
        vllm.popen.wait(timeout=30)
        time.sleep(down_s)
        mark("vllm_restart")
        stack.adopt(
            "vllm",
            processes.start_vllm(
                model_dir=stack.target_dir,
                served_model_name=stack.model,
                port=vllm.extra["port"],
                log_dir=stack.log_dir,
            ),
        )
        mark("vllm_up")
        time.sleep(settle_s)
        mark("load_stop")
        return events

    def _dump(self, stack: BenchStack) -> list[dict]:
        return json.loads(stack._manage("shell", "-c", RECORDS).split("RECORDS", 1)[1])

    def _records(self, stack: BenchStack, outcomes: list[Outcome], timeout_s: float = 60.0) -> dict[str, dict]:
        """The run's stage records by request id, once their number stops growing (writes are spawned)."""
        ids = {o.request_id for o in outcomes if o.request_id}
        deadline, last = time.monotonic() + timeout_s, -1
        while True:
            rows = {r["request_id"]: r for r in self._dump(stack) if r["request_id"] in ids}
            if len(rows) == last or time.monotonic() > deadline:
                return rows
            last = len(rows)
            time.sleep(3)

    def _metrics(self, stack: BenchStack) -> dict:
        """ACE's own /metrics after the run: request counters and fallbacks for the demo endpoint."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(stack.ace_url + "/metrics", timeout=30).text
        out: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(text):
            if family.name not in ("ace_requests", "ace_fallbacks", "ace_skips"):
                continue
            for sample in family.samples:
                if sample.name.endswith("_total") and sample.labels.get("endpoint") == "demo":
                    key = "/".join(v for k, v in sorted(sample.labels.items()) if k != "endpoint")
                    out.setdefault(family.name, {})[key] = sample.value
        return out


def _body(prompt: str, max_tokens: int) -> dict:
    return chat_body("demo", prompt, max_tokens)


async def _single(url: str, prompt: str, headers: dict, hang_s: float) -> Outcome:
    async with httpx.AsyncClient(timeout=hang_s + 5) as client:
        return await one_request(
            client,
            url,
            body=_body(prompt, 4),
            headers=headers,
            hang_s=hang_s,
            outcome=Outcome(lane=-1, prompt=0, started_s=0.0),
        )
