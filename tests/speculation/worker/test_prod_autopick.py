"""`draft: auto` in prod: each request runs its workload's winning candidate and K (the real task body, real Redis,
tiny models); the record says which and why; greedy output is plain greedy's whatever ran; too little evidence
keeps the policy's draft; a cached choice costs no database query; prod's run goes back into the evidence."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from speculation.jobs.admission import inflight_key

CODE_PROMPT = [1, 5, 6, 7, 9, 12, 5, 6, 7]
WRITING_PROMPT = [1, 40, 41, 42, 43, 44]


@pytest.fixture
def other_draft_dir(tiny_model_dir, tmp_path):
    """A second draft with the target's tokenizer and other (random) weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path / "other-draft"
    shutil.copytree(tiny_model_dir, out)
    torch.manual_seed(7)
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.num_hidden_layers = 1
    LlamaForCausalLM(config).save_pretrained(out)
    return out


def _rows(endpoint, workload: str, candidate: str, draft, peak_k: int, peak: float, n: int, kind: str = "") -> None:
    """n shadowed requests of one candidate, as shadow's replays store them (every K; draws alternate +-0.02)."""
    from speculation.models import CandidateMeasurement, DraftKind

    CandidateMeasurement.objects.bulk_create(
        CandidateMeasurement(
            endpoint=endpoint,
            request_id=f"{workload}-{candidate}-{i}",
            workload=workload,
            candidate=candidate,
            kind=kind or (DraftKind.DRAFT_MODEL if draft else DraftKind.NGRAM),
            draft=draft,
            multiplier=[round(peak + (0.02 if i % 2 else -0.02) - 0.1 * abs(k - peak_k), 4) for k in range(1, 9)],
            mean_accepted_len=[2.0] * 8,
            counts=[[k, 1, 3] for k in range(1, 9)],
        )
        for i in range(n)
    )


@pytest.fixture
def near_draft_dir(tiny_model_dir, tmp_path):
    """The target's own weights in a directory of their own (a draft the worker loads separately)."""
    return shutil.copytree(tiny_model_dir, tmp_path / "near-draft")


@pytest.fixture
def auto_endpoint(db, client, tiny_model_dir, near_draft_dir, other_draft_dir):
    """Prod on the local path with `draft: auto`; the policy's own draft is `other`. Shadow's evidence: code ->
    `near` at K = 6; writing -> n-gram at K = 2; qa: 3 requests only."""
    from fleet.models import Endpoint
    from speculation.models import DraftModel, SpeculationPolicy
    from speculation.worker import autopick
    from speculation.worker.baseline import _key
    from tests.support.models import serves

    endpoint = Endpoint.objects.create(name="tiny-auto", base_url="http://127.0.0.1:9", node_class="cpu")
    serves(endpoint, tiny_model_dir)  # the probe's record of the served model: the target reproduces it
    near = DraftModel.objects.create(name="near", kind="draft_model", path=str(near_draft_dir))
    other = DraftModel.objects.create(name="other", kind="draft_model", path=str(other_draft_dir))
    SpeculationPolicy.objects.update_or_create(
        endpoint=endpoint,
        defaults={
            "mode": "prod",
            "mechanism": "draft_model",
            "draft": other,
            "k": 3,
            "path": "local",
            "target_path": str(tiny_model_dir),
            "auto_pairing": True,
        },
    )
    n = 12
    _rows(endpoint, "code", "near", near, 6, 2.0, n)
    _rows(endpoint, "code", "ngram", None, 4, 1.2, n)
    _rows(endpoint, "code", "other", other, 2, 1.05, n)
    _rows(endpoint, "writing", "near", near, 3, 1.3, n)
    _rows(endpoint, "writing", "ngram", None, 2, 1.8, n)
    _rows(endpoint, "writing", "other", other, 2, 1.0, n)
    _rows(endpoint, "qa", "near", near, 5, 3.0, 3)
    client.set(_key(endpoint.pk), json.dumps({"tok_s": 100.0, "at": time.time()}))  # no calibration call
    autopick.forget()
    yield endpoint
    autopick.forget()


def _job(client, endpoint, workload: str, prompt: list[int]) -> dict:
    request_id = f"auto-{workload}-{time.monotonic_ns()}"
    client.zadd(inflight_key("cpu"), {request_id: time.time() + 60})
    return {
        "request_id": request_id,
        "endpoint_id": endpoint.pk,
        "prompt_ids": prompt,
        "max_tokens": 24,
        "k": 3,
        "path": "local",
        "stop": {"ignore_eos": True},
        "node_class": "cpu",
        "workload": workload,
    }


def _run(client, job: dict) -> tuple[list[int], dict]:
    from speculation.jobs.channel import key
    from speculation.worker.generation import run_prod_generation

    run_prod_generation(job)
    messages = [json.loads(m) for m in client.lrange(key(job["request_id"]), 0, -1)]
    assert messages[-1]["type"] == "done", messages[-1]
    return [t for m in messages if m["type"] == "tokens" for t in m["ids"]], messages[-1]["stats"]


def _plain(tiny_model_dir, prompt: list[int]) -> list[int]:
    from speculation.engine import GenerationConfig, LocalTarget, generate_plain
    from speculation.worker.paths import resources

    target = LocalTarget(resources.model(str(tiny_model_dir)).model)
    return generate_plain(target, prompt, GenerationConfig(max_new_tokens=24)).tokens


def test_a_mixed_stream_runs_each_workloads_winner_and_the_record_says_so(auto_endpoint, client, tiny_model_dir):
    # when: a code request and a writing request (an English one) reach the worker
    code_tokens, code = _run(client, _job(client, auto_endpoint, "code", CODE_PROMPT))
    writing_tokens, writing = _run(client, _job(client, auto_endpoint, "writing", WRITING_PROMPT))
    # then: code ran the draft `near` at K = 6, writing ran n-gram at K = 2, each record saying why
    assert (code["mechanism"], code["k"]) == ("draft_model", 6)
    assert code["reason"].startswith("auto: code -> near K=6, projected 1.95x (12 code requests at 2.00x; "), code[
        "reason"
    ]
    assert (writing["mechanism"], writing["k"]) == ("ngram", 2)
    assert writing["reason"].startswith("auto: writing -> ngram K=2, projected 1.74x (12 writing requests at 1.80x"), (
        writing["reason"]
    )
    # the draft identical to the target drafted and had every draft accepted
    assert code["drafted_tokens"] > 0 and code["accepted_tokens"] == code["drafted_tokens"]
    # and: greedy output is plain greedy's whichever candidate ran
    assert code_tokens == _plain(tiny_model_dir, CODE_PROMPT)
    assert writing_tokens == _plain(tiny_model_dir, WRITING_PROMPT)


def test_a_workload_with_little_evidence_leans_on_the_pooled_means(auto_endpoint, client, tiny_model_dir):
    # qa has 3 requests (near at 2.99x at K = 5): shrunk toward near's pooled 1.67x over 27 requests
    tokens, stats = _run(client, _job(client, auto_endpoint, "qa", CODE_PROMPT))
    assert (stats["mechanism"], stats["k"]) == ("draft_model", 5)
    assert stats["reason"].startswith(
        "auto: qa -> near K=5, projected 2.46x (3 qa requests at 2.99x; 27 requests pooled at 1.67x)"
    ), stats["reason"]
    assert tokens == _plain(tiny_model_dir, CODE_PROMPT)


def test_a_cached_choice_costs_no_database_query(auto_endpoint, django_assert_num_queries):
    from speculation.models import SpeculationPolicy
    from speculation.worker import autopick

    policy = SpeculationPolicy.objects.select_related("draft").get(endpoint=auto_endpoint)
    first = autopick.choose(endpoint=auto_endpoint, policy=policy, workload="code", path="local", k=3)
    with django_assert_num_queries(0):
        again = autopick.choose(endpoint=auto_endpoint, policy=policy, workload="code", path="local", k=3)
        writing = autopick.choose(endpoint=auto_endpoint, policy=policy, workload="writing", path="local", k=3)
    assert again[1] == first[1] and again[0].draft.name == "near"
    assert writing[0].mechanism == "ngram" and writing[0].draft.name == "other"  # its tokenizer's source


def test_prods_run_goes_back_into_the_evidence_for_the_candidate_and_k_it_ran(auto_endpoint, client):
    from speculation.models import CandidateMeasurement, CostCalibration
    from speculation.selectors.autopairing import pairing_table

    CostCalibration.objects.create(
        endpoint=auto_endpoint,
        draft=None,
        node_class="cpu",
        path="local",
        target_step_ms=10.0,
        draft_step_ms=0.1,
        verify_ms={"2": 11.0, "3": 11.5},
    )
    job = _job(client, auto_endpoint, "writing", WRITING_PROMPT)
    _, stats = _run(client, job)
    row = CandidateMeasurement.objects.get(request_id=job["request_id"])
    assert (row.candidate, row.kind, row.workload, row.best_k) == ("ngram", "ngram", "writing", 2)
    assert row.mean_accepted_len[1] == pytest.approx(stats["mean_accepted_len"] or 1.0, abs=1e-4)
    assert [i for i, m in enumerate(row.multiplier) if m is not None] == [1]  # K = 2 only
    assert row.counts[1] == [stats["drafted_tokens"], stats["accepted_tokens"], stats["target_passes"]]
    (cell,) = [
        c
        for c in pairing_table(endpoint_id=auto_endpoint.pk)["workloads"]["writing"]["cells"]
        if c.candidate == "ngram"
    ]
    assert cell.requests == 13  # 12 shadowed + this prod request


def test_the_worker_holds_a_target_and_its_drafts_within_its_model_budget(
    tiny_model_dir, near_draft_dir, other_draft_dir, monkeypatch
):
    from speculation.worker.paths import resources

    target, near, other = dirs = [str(tiny_model_dir), str(near_draft_dir), str(other_draft_dir)]
    resources._loaded.clear()
    monkeypatch.setattr(resources, "budget_bytes", lambda: 0)
    size = {d: resources.model_bytes(resources.model(d)) for d in dirs}
    # given: a budget (bytes) that holds all three: the target and both drafts stay loaded together
    monkeypatch.setattr(resources, "budget_bytes", lambda: sum(size.values()))
    held = [resources.model(d) for d in dirs]
    assert list(resources._loaded) == dirs
    assert [resources.model(d) for d in dirs] == held  # none reloaded
    # when: the budget holds two; the target is used, then a draft: the least recently used draft goes
    monkeypatch.setattr(resources, "budget_bytes", lambda: size[target] + size[other])
    resources.model(target)
    resources.model(other)
    resources._evict()
    # then
    assert list(resources._loaded) == [target, other]
    assert resources.loaded_bytes() <= size[target] + size[other]
    resources._loaded.clear()


def test_a_workload_whose_winner_is_suffix_decoding_with_a_draft_fallback_runs_it(
    auto_endpoint, client, tiny_model_dir
):
    from speculation.models import CandidateMeasurement, CostCalibration, DraftModel
    from speculation.worker import autopick, suffix_store

    # given: chat's evidence names the hybrid with `near` at K = 4; the endpoint's store holds an earlier answer
    near = DraftModel.objects.get(name="near")
    _rows(auto_endpoint, "chat", "suffix+near", near, 4, 2.5, 12, kind="suffix_draft")
    _rows(auto_endpoint, "chat", "near", near, 4, 1.5, 12)
    autopick.forget()
    plain = _plain(tiny_model_dir, WRITING_PROMPT)
    suffix_store.remember(auto_endpoint.pk, "earlier", plain)
    calibration = dict(node_class="cpu", path="local", target_step_ms=10.0, draft_step_ms=2.0)
    CostCalibration.objects.create(endpoint=auto_endpoint, draft=near, verify_ms={"2": 11.0, "9": 14.0}, **calibration)
    # when: a chat request asks what was answered before
    job = _job(client, auto_endpoint, "chat", WRITING_PROMPT)
    tokens, stats = _run(client, job)
    # then: the hybrid ran at K = 4 and said so; the output is plain greedy's
    assert (stats["mechanism"], stats["k"]) == ("suffix_draft", 4)
    assert stats["reason"].startswith("auto: chat -> suffix+near K=4"), stats["reason"]
    assert tokens == plain
    # the store's answer was drafted and accepted: fewer passes than tokens
    assert stats["accepted_tokens"] > 0 and stats["target_passes"] < len(tokens)
    # and prod's own row is the hybrid's, its projection charging the draft step for the model's drafts only
    row = CandidateMeasurement.objects.get(request_id=job["request_id"])
    assert (row.candidate, row.kind, row.draft_id, row.best_k) == ("suffix+near", "suffix_draft", near.pk, 4)
    drafted, accepted, passes = row.counts[3]
    costs = CostCalibration.objects.get(draft=near).step_costs()
    every_draft_charged = costs.multiplier(tokens_per_step=1 + accepted / passes, k=drafted / passes)
    assert row.multiplier[3] > round(every_draft_charged, 4)
