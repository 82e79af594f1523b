"""`draft: auto` in prod through the whole stack (the openai client, ACE's gateway, real Redis, a Celery worker, the
real vLLM serving the demo target): a mixed stream runs each workload's winning candidate and K, the stage record
says which and why, the greedy output equals off's, and each request's own measurement joins the table."""

from __future__ import annotations

import time

import pytest

from speculation.models import CandidateMeasurement, StageRecord
from speculation.selectors.autopairing import PROD_MIN_REQUESTS
from speculation.services.drafts import register_draft
from speculation.services.policies import update_policy
from tests.support.stack import register_probed_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.worker, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

STREAM = [  # (workload key, prompt): code and English, interleaved
    ("code", "def fibonacci(n):"),
    ("english", "Write a short note to a colleague about the meeting tomorrow."),
    ("code", "import os\nimport sys\n\n\ndef main():"),
    ("english", "Summarize the plot of a story about a lighthouse keeper."),
]
MAX_TOKENS = 24


def _shadow_evidence(endpoint, draft) -> None:
    """What shadow's candidate replays would have stored: code -> n-gram at K = 2, english -> demo-draft at K = 6
    (PROD_MIN_REQUESTS + 2 requests each, every K, draws alternating +-0.02)."""
    rows = []
    for workload, winner, loser in (("code", "ngram", "demo-draft"), ("english", "demo-draft", "ngram")):
        for name, peak_k, peak in ((winner, 2 if winner == "ngram" else 6, 1.9), (loser, 4, 1.1)):
            for i in range(PROD_MIN_REQUESTS + 2):
                jitter = 0.02 if i % 2 else -0.02
                rows.append(
                    CandidateMeasurement(
                        endpoint=endpoint, request_id=f"shadow-{workload}-{name}-{i}", workload=workload,
                        candidate=name, kind="ngram" if name == "ngram" else "draft_model",
                        draft=None if name == "ngram" else draft,
                        multiplier=[round(peak + jitter - 0.1 * abs(k - peak_k), 4) for k in range(1, 9)],
                        mean_accepted_len=[2.0] * 8, counts=[[k, 1, 3] for k in range(1, 9)],
                    )
                )  # fmt: skip
    CandidateMeasurement.objects.bulk_create(rows)


def _records(endpoint, count: int, timeout_s: float = 90.0) -> list[StageRecord]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(StageRecord.objects.filter(endpoint=endpoint, mode="prod").order_by("id"))
        if len(found) >= count:
            return found
        time.sleep(0.3)
    raise AssertionError(f"expected {count} prod records, found {len(found)}")


def _completion(client, model: str, workload: str, prompt: str) -> list[int]:
    reply = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
        extra_headers={"X-ACE-Workload": workload},
    )
    return reply.choices[0].model_extra["token_ids"]


def test_a_mixed_stream_in_prod_runs_each_workloads_winner_with_off_s_output(
    vllm_server, demo_pair, celery_worker, gateway_client
):
    # given: the demo endpoint, its draft, shadow's evidence, and off's answers
    endpoint = register_probed_endpoint(name="demo", base_url=vllm_server.base_url)
    draft = register_draft(name="demo-draft", kind="draft_model", path=str(demo_pair.draft_dir))
    _shadow_evidence(endpoint, draft)
    off = [_completion(gateway_client, endpoint.name, workload, prompt) for workload, prompt in STREAM]
    # when: prod with draft: auto on the local path (the policy's own pairing: demo-draft at K = 3)
    update_policy(
        endpoint=endpoint, mode="prod", mechanism="draft_model", draft=draft, k=3, path="local",
        target_path=str(demo_pair.target_dir), auto_pairing=True,
    )  # fmt: skip
    prod = [_completion(gateway_client, endpoint.name, workload, prompt) for workload, prompt in STREAM]
    # then: the same tokens as off, each request speculated with its workload's winner, the record saying why
    assert prod == off
    records = _records(endpoint, len(STREAM))
    assert [(r.action, r.workload, r.mechanism, r.k) for r in records] == [
        ("speculated", "code", "ngram", 2),
        ("speculated", "english", "draft_model", 6),
        ("speculated", "code", "ngram", 2),
        ("speculated", "english", "draft_model", 6),
    ]
    assert records[0].reason.startswith("auto: code -> ngram K=2, projected"), records[0].reason
    assert f"({PROD_MIN_REQUESTS + 2} code requests at 1.90x;" in records[0].reason
    assert records[1].reason.startswith("auto: english -> demo-draft K=6, projected"), records[1].reason
    assert f"({PROD_MIN_REQUESTS + 2} english requests at 1.90x;" in records[1].reason
    # and: each prod request's own acceptance joined the evidence for the candidate and K it ran
    deadline = time.monotonic() + 30
    while CandidateMeasurement.objects.filter(request_id__in=[r.request_id for r in records]).count() < len(STREAM):
        assert time.monotonic() < deadline, "prod's evidence rows were not written"
        time.sleep(0.3)
    evidence = {
        row.request_id: (row.candidate, row.best_k)
        for row in CandidateMeasurement.objects.filter(request_id__in=[r.request_id for r in records])
    }
    assert [evidence[r.request_id] for r in records] == [("ngram", 2), ("demo-draft", 6)] * 2
