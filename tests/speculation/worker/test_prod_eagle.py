"""An EAGLE head on the prod local path: the worker drafts with it (the engine's EagleProposer in the one loop)
and the greedy output is token-identical to plain decoding of the target (tiny models, real Redis)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from speculation.jobs.admission import inflight_key


@pytest.fixture
def eagle_job(db, client, tiny_model_dir, tmp_path):
    """A greedy prod job on the local path of an endpoint whose target is the tiny model, drafted by an EAGLE head
    saved for that target (untrained: its drafts are checked like any other)."""
    from fleet.models import Endpoint
    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights
    from speculation.models import DraftModel, SpeculationPolicy
    from speculation.worker.baseline import _key
    from tests.support.models import serves

    head = EagleHead(EagleConfig.for_target(tiny_model_dir))
    init_weights(head, torch.Generator().manual_seed(0))
    head.save(tmp_path / "head")
    endpoint = Endpoint.objects.create(name="tiny-eagle", base_url="http://127.0.0.1:9", node_class="cpu")
    serves(endpoint, tiny_model_dir)  # the probe's record of the served model: the target reproduces it
    draft = DraftModel.objects.create(name="tiny-head", kind="eagle_head", path=str(tmp_path / "head"))
    SpeculationPolicy.objects.update_or_create(
        endpoint=endpoint,
        defaults={
            "mode": "prod",
            "mechanism": "eagle_head",
            "draft": draft,
            "k": 3,
            "path": "local",
            "target_path": str(tiny_model_dir),
        },
    )
    client.set(_key(endpoint.pk), json.dumps({"tok_s": 100.0, "at": time.time()}))  # no calibration call
    request_id = f"eagle-{time.monotonic_ns()}"
    client.zadd(inflight_key("cpu"), {request_id: time.time() + 60})
    return {
        "request_id": request_id,
        "endpoint_id": endpoint.pk,
        "prompt_ids": [1, 5, 6, 7, 9, 12],
        "max_tokens": 30,
        "k": 3,
        "path": "local",
        "stop": {"ignore_eos": True},
        "node_class": "cpu",
    }


def test_an_eagle_head_on_the_local_path_speculates_with_plain_greedy_output(eagle_job, client, tiny_model_dir):
    from speculation.engine import GenerationConfig, LocalTarget, generate_plain
    from speculation.jobs.channel import key
    from speculation.worker.generation import run_prod_generation
    from speculation.worker.paths import resources

    # when: the worker runs the job
    run_prod_generation(eagle_job)
    # then: it streamed plain greedy's tokens and finished with speculation stats (drafts were checked)
    messages = [json.loads(m) for m in client.lrange(key(eagle_job["request_id"]), 0, -1)]
    assert [m["type"] for m in messages][0] == "ready", messages
    assert messages[-1]["type"] == "done", messages[-1]
    streamed = [t for m in messages if m["type"] == "tokens" for t in m["ids"]]
    target = LocalTarget(resources.model(str(tiny_model_dir)).model)
    plain = generate_plain(target, eagle_job["prompt_ids"], GenerationConfig(max_new_tokens=30)).tokens
    assert streamed == plain
    stats = messages[-1]["stats"]
    assert stats["drafted_tokens"] > 0
    assert stats["target_passes"] < len(plain) + 1 or stats["accepted_tokens"] == 0
    assert messages[-1]["finish_reason"] == "length"


def test_a_tree_policy_on_the_local_path_verifies_draft_trees_with_plain_greedy_output(
    eagle_job, client, tiny_model_dir, monkeypatch
):
    from speculation.engine import batch
    from speculation.models import SpeculationPolicy
    from speculation.worker.generation import run_prod_generation

    # given: the policy drafts an EAGLE-2 tree (two candidates per level, depth 4, 6 nodes; K = 3 caps the depth)
    SpeculationPolicy.objects.filter(endpoint_id=eagle_job["endpoint_id"]).update(
        eagle_tree={"top_k": 2, "depth": 4, "nodes": 6}
    )
    trees: list[tuple[int, int]] = []  # (nodes, depth) of every tree the target verified
    verify_tree_step = batch.verify_tree_step

    def counted(target, last_token, tree, *args, **kwargs):
        trees.append((tree.size, tree.depth))
        return verify_tree_step(target, last_token, tree, *args, **kwargs)

    monkeypatch.setattr(batch, "verify_tree_step", counted)  # a spy: the real verification runs
    # when: the worker runs the job
    run_prod_generation(eagle_job)
    # then: every step verified a tree (branching: more nodes than levels), and the output is plain greedy's
    messages = streamed_plain_greedy(eagle_job, client, tiny_model_dir)
    assert trees and all(depth <= 3 for _, depth in trees)
    assert any(nodes > depth for nodes, depth in trees)
    stats = messages[-1]["stats"]
    assert stats["drafted_tokens"] > 0 and stats["target_passes"] >= len(trees)  # a pass per tree, plain steps besides


def test_a_tree_policy_with_dynamic_k_lets_the_controller_choose_the_trees_shape_and_stays_plain_greedy(
    eagle_job, client, tiny_model_dir, monkeypatch
):
    import re

    from speculation.engine import batch
    from speculation.models import SpeculationPolicy
    from speculation.worker import generation

    # given: the tree policy with dynamic K (the lookahead controller chooses the chain, the tree cut to half its
    # nodes, or the tree, and the depth within K = 3, each step)
    SpeculationPolicy.objects.filter(endpoint_id=eagle_job["endpoint_id"]).update(
        eagle_tree={"top_k": 2, "depth": 4, "nodes": 6}, dynamic_k=True
    )
    monkeypatch.setattr(generation, "_TREE_LOOKAHEADS", {})  # a fresh controller (they live for the process)
    trees: list[tuple[int, int, int]] = []  # (nodes, depth, widest level) of every tree the target verified
    verify_tree_step = batch.verify_tree_step

    def counted(target, last_token, tree, *args, **kwargs):
        widest = int(torch.bincount(tree.depths).max())
        trees.append((tree.size, tree.depth, widest))
        return verify_tree_step(target, last_token, tree, *args, **kwargs)

    monkeypatch.setattr(batch, "verify_tree_step", counted)  # a spy: the real verification runs
    # when: the worker runs the job
    generation.run_prod_generation(eagle_job)
    # then: the output is plain greedy's; chains (one node per level) and branching trees were both verified
    messages = streamed_plain_greedy(eagle_job, client, tiny_model_dir)
    assert trees and all(depth <= 3 for _, depth, _ in trees)
    assert any(widest == 1 for _, _, widest in trees) and any(widest > 1 for _, _, widest in trees), trees
    # and the record's reason says how many steps each shape drafted (every shape of the family was tried)
    reason = messages[-1]["stats"]["reason"]
    counts = dict(re.findall(r"([\w-]+) (\d+)", reason.split("drafting steps per shape:", 1)[1]))
    assert set(counts) == {"chain", "k2-n3", "k2-n6"}, reason
    assert all(int(n) > 0 for n in counts.values()), reason
    assert sum(map(int, counts.values())) == len(trees), (reason, trees)


def streamed_plain_greedy(job: dict, client, tiny_model_dir) -> list[dict]:
    """The job's messages, after checking that it finished and streamed exactly plain greedy decoding's tokens."""
    from speculation.engine import GenerationConfig, LocalTarget, generate_plain
    from speculation.jobs.channel import key
    from speculation.worker.paths import resources

    messages = [json.loads(m) for m in client.lrange(key(job["request_id"]), 0, -1)]
    assert messages[-1]["type"] == "done", messages[-1]
    streamed = [t for m in messages if m["type"] == "tokens" for t in m["ids"]]
    target = LocalTarget(resources.model(str(tiny_model_dir)).model)
    plain = generate_plain(target, job["prompt_ids"], GenerationConfig(max_new_tokens=job["max_tokens"])).tokens
    assert streamed == plain
    return messages
