"""python manage.py bench_gateway [--quick] [--json PATH]

One run, one process, against the real vLLM serving the demo target (every process started here and stopped
at the end): direct to vLLM vs through ACE in off mode (added latency p50/p99, throughput ratio at 1, 8, 32
concurrent streams), then shadow and prod on the same greedy requests (tok/s multiplier per path, whether
prod's tokens equal off's, shadow's replayed acceptance vs the acceptance prod then sees, shadow_vs_prod: shadow's
projected multiplier over the one prod measured on the same prompts), prod_coverage: the share of a mixed greedy
request set (stop strings, echo, min_tokens, ...) that prod speculates, and concurrency: prod (local path) vs off
and vs the same path at K = 0 at 1, 8 and 32 streams, greedy and sampled (speculation.bench.concurrency).

--managed instead benchmarks one managed endpoint (speculation.bench.managed): off vs prod with the
server's own n-gram and draft-model speculation at 1, 8, 32 streams, and the blue/green switches between them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import platform
import random
import time
from datetime import UTC, datetime
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from speculation import drafting
from speculation.bench import concurrency as concurrency_bench
from speculation.bench import coverage
from speculation.bench.load import load_prompts, paired_latencies, quantile, run_concurrent
from speculation.bench.stack import BenchStack
from speculation.drafting.mechanisms import HEAD_WEIGHTS
from speculation.offline.eagle.prompts import spec_bench_path

logger = logging.getLogger(__name__)

DATASET = spec_bench_path()  # the vendored Spec-Bench questions (ACE_SPEC_BENCH overrides)
K = 3


def _tok_s(results) -> float:
    latency = sum(r.latency_s for r in results)
    return sum(r.tokens for r in results) / latency if latency else 0.0


class Command(BaseCommand):
    help = "Benchmark the gateway: off-mode overhead and throughput vs direct, prod multiplier per path."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--quick", action="store_true", help="fewer requests (a few minutes on 2 CPU cores)")
        parser.add_argument("--json", dest="json_path", help="write the results there as JSON")
        parser.add_argument("--dataset", default=str(DATASET), help="Spec-Bench question.jsonl")
        parser.add_argument("--no-native", action="store_true", help="skip the native path (a second vLLM)")
        parser.add_argument(
            "--only",
            default="",
            help="comma-separated sections to run alone: shadow_vs_prod, concurrency (no overhead, throughput, remote "
            "path, coverage, native)",
        )
        parser.add_argument(
            "--managed", action="store_true", help="off vs native prod and the switches on a managed endpoint"
        )
        parser.add_argument(
            "--concurrency-rounds",
            type=int,
            default=3,
            help="concurrency: run each load this many times in a row in off and in prod (the goodput guard learns "
            "in the first rounds and acts in the later ones; default 3)",
        )
        parser.add_argument(
            "--mechanism",
            choices=tuple(drafting.MECHANISMS),
            default=None,
            help="coverage and concurrency: what prod drafts with (default: the run command's pairing, the demo's "
            "EAGLE head at dynamic K; the demo draft where no head is shipped or built)",
        )
        parser.add_argument(
            "--fresh-prompts",
            action="store_true",
            help="concurrency: every round sends prompts no earlier round sent (no prefix-cache or suffix-store hits "
            "from repeats); default: each round repeats the first prompts",
        )
        parser.add_argument(
            "--concurrency-streams",
            default=",".join(str(c) for c in concurrency_bench.CONCURRENCY),
            help="concurrency: the loads (streams at once) to run, comma-separated (default 1,8,32)",
        )

    def handle(
        self,
        *args,
        quick: bool,
        json_path: str | None,
        dataset: str,
        no_native: bool,
        managed: bool,
        only: str,
        concurrency_rounds: int,
        concurrency_streams: str,
        mechanism: str | None = None,
        fresh_prompts: bool = False,
        **options,
    ) -> None:
        from speculation.offline.demo import ensure_demo_pair
        from speculation.offline.eagle.demo_head import default_head_dir

        if concurrency_rounds < 1:
            raise CommandError(f"--concurrency-rounds must be at least 1, not {concurrency_rounds}", returncode=2)
        loads = _loads(concurrency_streams)

        started = time.perf_counter()
        pair = ensure_demo_pair()
        head_dir = default_head_dir(pair)
        eagle_dir = head_dir if (head_dir / "config.json").is_file() else None
        mechanism = mechanism or ("eagle_head" if eagle_dir else "draft_model")
        if drafting.for_kind(mechanism).weights == HEAD_WEIGHTS and eagle_dir is None:
            message = f"--mechanism {mechanism}: no EAGLE head for the demo target in {head_dir}"
            raise CommandError(message, returncode=2)
        if managed:
            self._managed(pair, quick=quick, json_path=json_path, dataset=dataset, started=started)
            return
        plan = {
            "overhead_n": 40 if quick else 200,
            "throughput_requests": {1: 4, 8: 16, 32: 32} if quick else {1: 8, 8: 32, 32: 64},
            "throughput_max_tokens": 16 if quick else 32,
            "prod_prompts": 1 if quick else 2,  # per Spec-Bench category
            "prod_max_tokens": 32 if quick else 64,
            "coverage_prompts": 2 if quick else 6,  # x 8 request variants + 1 (speculation.bench.coverage)
            # per load: 2 (quick) or 4 requests per stream at one stream, one (quick) or two per stream above
            "concurrency_requests": {c: (2 if quick else 4) * c if c == 1 else (1 if quick else 2) * c for c in loads},
            "concurrency_max_tokens": 32 if quick else 64,
            "concurrency_rounds": concurrency_rounds,
            "concurrency_loads": loads,
            "concurrency_mechanism": mechanism,
            "concurrency_fresh_prompts": fresh_prompts,
        }
        prompts = [p for _, p in load_prompts(Path(dataset), per_category=plan["prod_prompts"])]
        self.concurrency_prompts = prompts
        if fresh_prompts:  # enough for every round of every load (Spec-Bench has 480), categories mixed
            self.concurrency_prompts = [p for _, p in load_prompts(Path(dataset), per_category=40)]
            random.Random(0).shuffle(self.concurrency_prompts)
        sections = {name.strip() for name in only.split(",") if name.strip()}
        if sections - {"shadow_vs_prod", "concurrency"}:
            raise CommandError(f"--only takes shadow_vs_prod and/or concurrency, not {only!r}", returncode=2)
        with_native = not (no_native or sections)
        stack = BenchStack(
            target_dir=pair.target_dir, draft_dir=pair.draft_dir, eagle_dir=eagle_dir, with_native=with_native
        )
        self.stderr.write(f"starting redis, vLLM{' x2' if with_native else ''}, worker, ACE (logs {stack.log_dir})")
        stack.start()
        try:
            results = self._sections(stack, prompts, plan, sections) if sections else self._run(stack, prompts, plan)
        finally:
            stack.stop()
        results["meta"] = {
            "quick": quick,
            "plan": {k: str(v) for k, v in plan.items()},
            "prompts": len(prompts),
            "k": K,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - started, 1),
        }
        text = json.dumps(results, indent=2)
        self.stdout.write(text)
        if json_path:
            Path(json_path).write_text(text + "\n")

    def _managed(self, pair, *, quick: bool, json_path: str | None, dataset: str, started: float) -> None:
        from speculation.bench import managed

        plan = {
            "requests": {1: 2, 8: 8, 32: 32} if quick else {1: 4, 8: 16, 32: 64},
            "max_tokens": 16 if quick else 32,
            "switch_back": not quick,  # prod -> off too (one more vLLM start)
        }
        prompts = [p for _, p in load_prompts(Path(dataset), per_category=1)]
        results = managed.run(
            target_dir=pair.target_dir, draft_dir=pair.draft_dir, prompts=prompts, plan=plan, log=self.stderr.write
        )
        results["meta"] = {
            "quick": quick,
            "plan": {k: str(v) for k, v in plan.items()},
            "k": managed.K,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "wall_s": round(time.perf_counter() - started, 1),
        }
        text = json.dumps(results, indent=2)
        self.stdout.write(text)
        if json_path:
            Path(json_path).write_text(text + "\n")

    def _run(self, stack: BenchStack, prompts: list[str], plan: dict) -> dict:
        out: dict = {}
        headers = stack.headers
        # 1. off-mode overhead, sequential, interleaved, max_tokens 1
        direct, ace = asyncio.run(
            paired_latencies(
                stack.vllm_url,
                stack.ace_url,
                model=stack.model,
                ace_model="demo",
                prompt=prompts[0],
                n=plan["overhead_n"],
                headers=headers,
            )
        )
        out["direct_latency_ms_p50"] = round(quantile(direct, 0.5) * 1000, 3)
        out["ace_off_latency_ms_p50"] = round(quantile(ace, 0.5) * 1000, 3)
        out["overhead_ms_p50"] = round((quantile(ace, 0.5) - quantile(direct, 0.5)) * 1000, 3)
        out["overhead_ms_p99"] = round((quantile(ace, 0.99) - quantile(direct, 0.99)) * 1000, 3)
        self.stderr.write(f"overhead p50 {out['overhead_ms_p50']} ms, p99 {out['overhead_ms_p99']} ms")
        # 2. throughput at 1, 8, 32 concurrent streams
        out["throughput_ratio"] = {}
        out["throughput_tok_s"] = {}
        for concurrency, count in plan["throughput_requests"].items():
            batch = [prompts[i % len(prompts)] for i in range(count)]
            kwargs = dict(prompts=batch, max_tokens=plan["throughput_max_tokens"], concurrency=concurrency)
            wall_d, res_d = asyncio.run(run_concurrent(stack.vllm_url, model=stack.model, headers={}, **kwargs))
            wall_a, res_a = asyncio.run(run_concurrent(stack.ace_url, model="demo", headers=headers, **kwargs))
            direct_tps = sum(r.tokens for r in res_d) / wall_d
            ace_tps = sum(r.tokens for r in res_a) / wall_a
            out["throughput_tok_s"][str(concurrency)] = {"direct": round(direct_tps, 2), "ace_off": round(ace_tps, 2)}
            out["throughput_ratio"][str(concurrency)] = round(ace_tps / direct_tps, 4)
            self.stderr.write(f"throughput at {concurrency}: ratio {out['throughput_ratio'][str(concurrency)]}")
        # 3. off reference outputs (greedy), then shadow, then prod per path, same requests
        run = dict(prompts=prompts, max_tokens=plan["prod_max_tokens"], concurrency=1, headers=headers)
        _, off = asyncio.run(run_concurrent(stack.ace_url, model="demo", **run))
        off_tps = _tok_s(off)
        stack.set_policy(  # shadow projects for the local path: shadow_vs_prod compares it with prod local
            "demo",
            mode="shadow",
            mechanism="draft_model",
            draft="demo-draft",
            k=K,
            shadow_sample_rate=1.0,
            path="local",
            target_path=str(stack.target_dir),
        )
        _, shadow = asyncio.run(run_concurrent(stack.ace_url, model="demo", **run))
        shadow_records = self._wait_records(stack, "demo", "shadow", len(prompts), projected=True)
        out["shadow_identical_to_off"] = [r.token_ids for r in shadow] == [r.token_ids for r in off]
        out["prod_multiplier"] = {}
        out["prod_greedy_identical"] = {}
        out["prod_tok_s"] = {"off": round(off_tps, 2)}
        prod_records: dict[str, list[dict]] = {}
        for path, extra in (
            ("remote", {"path": "remote"}),
            ("local", {"path": "local", "target_path": str(stack.target_dir)}),
        ):
            stack.set_policy("demo", mode="prod", **extra)
            _, prod = asyncio.run(run_concurrent(stack.ace_url, model="demo", **run))
            records = self._wait_records(stack, "demo", "prod", len(prompts) * (1 + len(prod_records)))
            prod_records[path] = [r for r in records if r["path"] == path]
            tps = _tok_s(prod)
            out["prod_tok_s"][path] = round(tps, 2)
            out["prod_multiplier"][path] = round(tps / off_tps, 4)
            out["prod_greedy_identical"][path] = [r.token_ids for r in prod] == [r.token_ids for r in off]
            actions = {r["action"] for r in prod_records[path]}
            out.setdefault("prod_actions", {})[path] = sorted(actions)
            self.stderr.write(
                f"prod {path}: x{out['prod_multiplier'][path]}, identical "
                f"{out['prod_greedy_identical'][path]}, actions {sorted(actions)}"
            )
        out["shadow_vs_prod"] = concurrency_bench.shadow_vs_prod(shadow_records, prod_records["local"])
        self.stderr.write(f"shadow vs prod (local): {out['shadow_vs_prod']}")
        stack.set_demo_pairing(k=concurrency_bench.PROD_K, mechanism=plan["concurrency_mechanism"])
        out.update(self._coverage(stack, prompts[: plan["coverage_prompts"]], plan["prod_max_tokens"]))
        stack.set_policy("demo", mode="off")
        out.update(self._alphas(shadow_records, prod_records["remote"]))
        if stack.ngram_url:
            out["prod_multiplier"]["native"], out["native"] = self._native(stack, run, off_tps)
        measured = concurrency_bench.run_all(  # last: it leaves the worker at K = 0
            stack,
            self.concurrency_prompts,
            requests=plan["concurrency_requests"],
            max_tokens=plan["concurrency_max_tokens"],
            log=self.stderr.write,
            rounds=plan["concurrency_rounds"],
            loads=plan["concurrency_loads"],
            mechanism=plan["concurrency_mechanism"],
            fresh=plan["concurrency_fresh_prompts"],
        )
        out["concurrency"] = concurrency_bench.shape(measured)
        return out

    def _sections(self, stack: BenchStack, prompts: list[str], plan: dict, sections: set[str]) -> dict:
        """shadow_vs_prod (the same greedy prompts, one at a time: shadow projecting for the local path, then prod
        on it) and/or the concurrency section."""
        out: dict = {}
        if "shadow_vs_prod" in sections:
            out.update(self._shadow_vs_prod(stack, prompts, plan))
        if "concurrency" in sections:
            measured = concurrency_bench.run_all(
                stack,
                self.concurrency_prompts,
                requests=plan["concurrency_requests"],
                max_tokens=plan["concurrency_max_tokens"],
                log=self.stderr.write,
                rounds=plan["concurrency_rounds"],
                loads=plan["concurrency_loads"],
                mechanism=plan["concurrency_mechanism"],
                fresh=plan["concurrency_fresh_prompts"],
            )
            out["concurrency"] = concurrency_bench.shape(measured)
        return out

    def _shadow_vs_prod(self, stack: BenchStack, prompts: list[str], plan: dict) -> dict:
        """Each mode first serves one warm-up request, left out of the pairs, as on an endpoint that has run a while:
        shadow's waits for the first cost calibration (before it, records are projected at the policy's K when it
        lands, not at the K prod's controller would choose), prod's lets the batch loop's controller measure its
        step sizes (a fresh decoder's first steps measure K = k, k // 2 and 0, twice each)."""
        run = dict(max_tokens=plan["prod_max_tokens"], concurrency=1, headers=stack.headers)
        warm_up = [prompts[0] + " Answer briefly."]
        stack.set_policy(
            "demo",
            mode="shadow",
            mechanism="draft_model",
            draft="demo-draft",
            k=K,
            shadow_sample_rate=1.0,
            path="local",
            target_path=str(stack.target_dir),
        )
        records = {}
        for mode in ("shadow", "prod"):
            if mode == "prod":
                stack.set_policy("demo", mode="prod")
            asyncio.run(run_concurrent(stack.ace_url, model="demo", prompts=warm_up, **run))
            seen = {r["id"] for r in self._wait_records(stack, "demo", mode, 1, projected=mode == "shadow")}
            asyncio.run(run_concurrent(stack.ace_url, model="demo", prompts=prompts, **run))
            measured = self._wait_records(stack, "demo", mode, len(seen) + len(prompts), projected=mode == "shadow")
            records[mode] = [r for r in measured if r["id"] not in seen]
        prod = [r for r in records["prod"] if r["path"] == "local"]
        out = {"shadow_vs_prod": concurrency_bench.shadow_vs_prod(records["shadow"], prod)}
        self.stderr.write(f"shadow vs prod (local): {out['shadow_vs_prod']}")
        return out

    def _coverage(self, stack: BenchStack, prompts: list[str], max_tokens: int) -> dict:
        """prod_coverage on the local path with the demo pairing (--mechanism): speculated / requests."""
        requests = coverage.mixed_requests(prompts, model="demo", max_tokens=max_tokens)
        seen = {r["id"] for r in stack.records("demo", mode="prod")}
        statuses = coverage.run(stack.ace_url, requests, headers=stack.headers)
        records = self._wait_records(stack, "demo", "prod", len(seen) + len(requests))
        result = coverage.summarize(sorted((r for r in records if r["id"] not in seen), key=lambda r: r["id"]))
        result["prod_coverage_http_ok"] = sum(1 for s in statuses if s == 200)
        self.stderr.write(f"prod coverage {result['prod_coverage']} of {len(requests)} mixed greedy requests")
        return result

    def _native(self, stack: BenchStack, run: dict, off_tps: float) -> tuple[float, dict]:
        stack.set_policy("demo-ngram", mode="prod", mechanism="ngram", k=K)
        _, prod = asyncio.run(run_concurrent(stack.ace_url, model="demo-ngram", **run))
        records = self._wait_records(stack, "demo-ngram", "prod", len(prod))
        drafted = sum(r["drafted_tokens"] for r in records)
        accepted = sum(r["accepted_tokens"] for r in records)
        tps = _tok_s(prod)
        info = {
            "tok_s": round(tps, 2),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "paths": sorted({r["path"] for r in records}),
            "actions": sorted({r["action"] for r in records}),
        }
        return round(tps / off_tps, 4), info

    @staticmethod
    def _alphas(shadow: list[dict], prod: list[dict]) -> dict:
        def agg(records: list[dict]) -> tuple[float | None, float | None]:
            drafted = sum(r["drafted_tokens"] for r in records)
            accepted = sum(r["accepted_tokens"] for r in records)
            alphas = [r["alpha"] for r in records if r["alpha"] is not None]
            return (
                round(sum(alphas) / len(alphas), 6) if alphas else None,
                round(accepted / drafted, 6) if drafted else None,
            )

        s_alpha, s_rate = agg(shadow)
        p_alpha, p_rate = agg(prod)
        key = ("drafted_tokens", "accepted_tokens", "target_passes")
        same = len(shadow) == len(prod) and all(
            tuple(a[k] for k in key) == tuple(b[k] for k in key)
            for a, b in zip(sorted(shadow, key=lambda r: r["id"]), sorted(prod, key=lambda r: r["id"]), strict=True)
        )
        return {
            "shadow_alpha": s_alpha,
            "prod_alpha": p_alpha,
            "shadow_acceptance_rate": s_rate,
            "prod_acceptance_rate": p_rate,
            "shadow_equals_prod_per_request": same,
        }

    @staticmethod
    def _wait_records(
        stack: BenchStack, endpoint: str, mode: str, count: int, timeout_s: float = 300, projected: bool = False
    ) -> list[dict]:
        """At least `count` records of the mode (projected: each with its multiplier), or what there is at the
        timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            records = stack.records(endpoint, mode=mode)
            ready = [r for r in records if r.get("multiplier") is not None] if projected else records
            if len(ready) >= count or time.monotonic() > deadline:
                return records
            time.sleep(0.5)


def _loads(text: str) -> tuple[int, ...]:
    """--concurrency-streams: distinct positive integers, comma-separated, in the order given."""
    loads: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or not 1 <= int(part) <= 256:
            raise CommandError(
                f"--concurrency-streams takes numbers of streams from 1 to 256, comma-separated, not {text!r}",
                returncode=2,
            )
        if int(part) not in loads:
            loads.append(int(part))
    return tuple(loads)
