"""Shadow replays the policy's EAGLE head as prod's local path drafts it: a chain of K, or the policy's draft tree
(`eagle_tree`) verified against the known output (speculation.engine.tree.replay_tree_greedy), through the shadow
task's real body on real Redis; the projection counts the verification of every node. The candidate replays
(auto-pairing) replay a head as the policy's tree too. A head without the target in the worker is not replayed."""

from __future__ import annotations

import pytest
import torch

from speculation.engine.projection import StepCosts
from speculation.engine.tree import TreeShape

K = 4
TREE = {"top_k": 3, "depth": 4, "nodes": 12}
PROMPT = [3, 9, 27, 1, 40, 2, 2, 41]
MEASURED = StepCosts(target_step_s=0.010, draft_step_s=0.001, verify_s={1: 0.006, 5: 0.009, 13: 0.020})


@pytest.fixture(scope="module")
def target_dir(tiny_model_dir, tmp_path_factory):
    """A tiny target whose logits are decisive (weights of std 0.5, 48 tokens; the tiny model's tokenizer), so a
    briefly trained head learns it (the tiny model's own near-uniform logits teach a head nothing)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("decisive-target")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copyfile(tiny_model_dir / name, out / name)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2)  # fmt: skip
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def head_dir(target_dir, tmp_path_factory):
    """A head for that target, trained briefly on the target's own greedy continuations (drafts accepted)."""
    from speculation.engine import load_causal_lm
    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights
    from tests.support.eagle import trained_head

    head = EagleHead(EagleConfig.for_target(target_dir))
    init_weights(head, torch.Generator().manual_seed(0))
    out = tmp_path_factory.mktemp("shadow-head")
    trained_head(load_causal_lm(target_dir), head, out / "work").save(out / "head")
    return out / "head"


@pytest.fixture
def tree_policy(db, redis_server, target_dir, head_dir, settings):
    from fleet.models import Endpoint
    from speculation.models import DraftModel, SpeculationPolicy
    from speculation.services.costs import record_calibration

    settings.CANDIDATE_REPLAYS_PER_MINUTE = 0  # the policy's own record only (candidates: the last test)
    endpoint = Endpoint.objects.create(name="tiny-tree", base_url="http://127.0.0.1:9", node_class="cpu")
    head = DraftModel.objects.create(name="tiny-head", kind="eagle_head", path=str(head_dir))
    policy, _ = SpeculationPolicy.objects.update_or_create(
        endpoint=endpoint,
        defaults={"mode": "shadow", "mechanism": "eagle_head", "draft": head, "k": K, "path": "local",
                  "target_path": str(target_dir), "eagle_tree": TREE},
    )  # fmt: skip
    record_calibration(endpoint=endpoint, draft=head, path="local", costs=MEASURED, repeats=5, context_tokens=8)
    return policy


def _output(target_dir) -> list[int]:
    """What a greedy server answers: the target's own greedy continuation."""
    from speculation.engine import GenerationConfig, LocalTarget, generate_plain
    from speculation.worker.paths import resources

    target = LocalTarget(resources.model(str(target_dir)).model)
    return generate_plain(target, PROMPT, GenerationConfig(max_new_tokens=40)).tokens


def _replays(target_dir, head_dir, output: list[int]):
    """The engine's own replays of the head on prompt + output: (tree, chain) at K."""
    from speculation.engine.eagle import EagleHead, EagleProposer
    from speculation.engine.replay import replay_proposer
    from speculation.worker.paths import resources

    model = resources.model(str(target_dir)).model
    head = EagleHead.load(head_dir, target_dir=target_dir)
    sequence = PROMPT + output
    with torch.inference_mode():
        hidden = model(torch.tensor(sequence), 0, return_hidden=True).hidden
    common = {"prompt_len": len(PROMPT), "max_new_tokens": len(output), "hidden": hidden}
    tree = replay_proposer(EagleProposer(head, model, tree=TreeShape(**TREE)), sequence, K, **common)
    chain = replay_proposer(EagleProposer(head, model), sequence, K, **common)
    return tree, chain


def _shadow(policy, request_id: str, output: list[int]) -> None:
    from speculation.worker.tasks import shadow_measure_task

    shadow_measure_task.apply(
        kwargs={"endpoint_id": policy.endpoint_id, "request_id": request_id, "prompt_ids": PROMPT,
                "output_ids": output, "finish_reason": "length", "max_tokens": len(output), "temperature": 0.0,
                "latency_ms": 400.0},
    )  # fmt: skip


def test_shadow_replays_the_policys_draft_tree_and_projects_the_verification_of_every_node(
    tree_policy, target_dir, head_dir
):
    from speculation.models import StageRecord

    # given: a greedy request, and what the engine's replays of the head give on it as a tree and as a chain
    output = _output(target_dir)
    tree, chain = _replays(target_dir, head_dir, output)
    assert tree.accepted_tokens > chain.accepted_tokens  # the request tells the two apart
    # when: the shadow task measures it
    _shadow(tree_policy, "tree-1", output)
    # then: the record is the tree's replay, not the chain's
    record = StageRecord.objects.get(request_id="tree-1")
    assert "tree" in record.reason and "EAGLE head" in record.reason, record.reason
    got = (record.target_passes, record.drafted_tokens, record.accepted_tokens)
    assert got == (tree.target_passes, tree.drafted_tokens, tree.accepted_tokens)
    assert record.mean_accepted_len == pytest.approx(tree.mean_accepted_len)
    # and its projection pays one verification of all the tree's nodes per step (12 at depth 4), not K + 1 tokens
    k_mean = tree.drafted_tokens / tree.target_passes
    nodes = k_mean * TREE["nodes"] / TREE["depth"]
    want = MEASURED.multiplier(tokens_per_step=tree.tokens_per_pass, k=k_mean, verified=nodes)
    assert record.multiplier == pytest.approx(want)
    assert record.multiplier < MEASURED.multiplier(tokens_per_step=tree.tokens_per_pass, k=k_mean)


def test_a_tree_record_projected_late_pays_the_verification_of_every_node_as_the_on_time_projection(
    tree_policy, target_dir, head_dir, monkeypatch
):
    from speculation.models import CostCalibration, StageRecord
    from speculation.services.costs import project_pending_records, record_calibration
    from speculation.worker import costs as worker_costs

    # given: no calibration stored yet, so the tree replay's record waits for one (its queueing is not under test)
    CostCalibration.objects.all().delete()
    monkeypatch.setattr(worker_costs, "request_calibration", lambda **kw: "a calibration was queued")
    output = _output(target_dir)
    tree, _ = _replays(target_dir, head_dir, output)
    _shadow(tree_policy, "tree-late", output)
    record = StageRecord.objects.get(request_id="tree-late")
    assert record.multiplier is None and worker_costs.PENDING in record.reason, record.reason
    # when: the calibration is stored and the pending records are projected
    row = record_calibration(endpoint=tree_policy.endpoint, draft=tree_policy.draft, path="local", costs=MEASURED,
                             repeats=5, context_tokens=8)  # fmt: skip
    assert project_pending_records(calibration=row, tag=f"local/{tree_policy.draft_id}", pending=worker_costs.PENDING)
    # then: the projection pays one verification of all the tree's nodes per step, as on time (the first test)
    record.refresh_from_db()
    k_mean = tree.drafted_tokens / tree.target_passes
    nodes = k_mean * TREE["nodes"] / TREE["depth"]
    costs = row.step_costs()
    assert record.multiplier == pytest.approx(costs.multiplier(tokens_per_step=tree.tokens_per_pass, k=k_mean,
                                                               verified=nodes))  # fmt: skip
    assert record.multiplier < costs.multiplier(tokens_per_step=tree.tokens_per_pass, k=k_mean)


def test_without_a_tree_shadow_replays_the_heads_chain(tree_policy, target_dir, head_dir):
    from speculation.models import StageRecord

    tree_policy.eagle_tree = {}
    tree_policy.save(update_fields=["eagle_tree"])
    output = _output(target_dir)
    _, chain = _replays(target_dir, head_dir, output)

    _shadow(tree_policy, "chain-1", output)

    record = StageRecord.objects.get(request_id="chain-1")
    assert (record.drafted_tokens, record.accepted_tokens) == (chain.drafted_tokens, chain.accepted_tokens)
    assert "tree" not in record.reason
    k_mean = chain.drafted_tokens / chain.target_passes
    assert record.multiplier == pytest.approx(MEASURED.multiplier(tokens_per_step=chain.tokens_per_pass, k=k_mean))


def test_a_head_without_the_target_in_the_worker_is_recorded_as_not_replayed(tree_policy, target_dir):
    from speculation.models import StageRecord

    tree_policy.target_path = ""
    tree_policy.save(update_fields=["target_path"])

    _shadow(tree_policy, "remote-1", _output(target_dir))

    record = StageRecord.objects.get(request_id="remote-1")
    assert "target's features" in record.reason and record.multiplier is None
    assert record.drafted_tokens is None or record.drafted_tokens == 0


def _sampled_output(target_dir, seed: int = 0) -> list[int]:
    """What a sampling server answers (temperature 0.7, top_p 0.9)."""
    from speculation.engine import GenerationConfig, LocalTarget, generate
    from speculation.worker.paths import resources

    target = LocalTarget(resources.model(str(target_dir)).model)
    config = GenerationConfig(max_new_tokens=40, temperature=0.7, top_p=0.9, seed=seed)
    return generate(target, None, PROMPT, config).tokens


def _shadow_sampled(policy, request_id: str, output: list[int]) -> None:
    from speculation.worker.tasks import shadow_measure_task

    shadow_measure_task.apply(
        kwargs={"endpoint_id": policy.endpoint_id, "request_id": request_id, "prompt_ids": PROMPT,
                "output_ids": output, "finish_reason": "length", "max_tokens": len(output), "temperature": 0.7,
                "top_p": 0.9, "latency_ms": 400.0},
    )  # fmt: skip


def test_a_sampled_request_replays_the_policys_tree_exactly(tree_policy, target_dir, head_dir):
    from speculation.models import StageRecord

    # given: a sampled answer (not the greedy one), and the engine's replay of the tree on it
    output = _sampled_output(target_dir)
    assert output != _output(target_dir)
    tree, _chain = _replays(target_dir, head_dir, output)
    # when
    _shadow_sampled(tree_policy, "sampled-1", output)
    # then: the tree's candidates are one-hot, so the replay against the sampled output is the run's count
    record = StageRecord.objects.get(request_id="sampled-1")
    assert "sampled (temperature 0.7" in record.reason and "tree" in record.reason, record.reason
    got = (record.target_passes, record.drafted_tokens, record.accepted_tokens)
    assert got == (tree.target_passes, tree.drafted_tokens, tree.accepted_tokens)
    assert tree.accepted_tokens > 0 and record.multiplier is not None


def _expected_chain(target_dir, head_dir, output: list[int]):
    """The head's sampled chain at K in expectation, from the engine's functions (p, q at temperature 0.7, top_p
    0.9): chain_logits_along and expected_hybrid over min(1, q(o) / p(o))."""
    from speculation.engine import SamplingParams, expected_hybrid
    from speculation.engine.eagle import EagleHead, chain_logits_along
    from speculation.engine.sampling import probs_from_logits
    from speculation.worker.paths import resources

    params = SamplingParams(temperature=0.7, top_p=0.9)
    model = resources.model(str(target_dir)).model
    head = EagleHead.load(head_dir, target_dir=target_dir)
    sequence = PROMPT + output
    with torch.inference_mode():
        hidden = model(torch.tensor(sequence), 0, return_hidden=True).hidden
        p = probs_from_logits(model(torch.tensor(sequence[:-1]), 0).logits[len(PROMPT) - 1 :].float(), params)
    chains = []
    for i, logits in enumerate(chain_logits_along(head, model, sequence, hidden, prompt_len=len(PROMPT), depth=K)):
        q = probs_from_logits(logits.float(), params)
        tokens = output[i : i + q.shape[0]]
        chains.append([min(1.0, float(q[j, t] / p[i + j, t])) for j, t in enumerate(tokens)])
    common = {"prompt_len": len(PROMPT), "lookup_k": K, "min_lookup": 1, "max_new_tokens": len(output)}
    return expected_hybrid(None, [0.0] * len(output), sequence, K, chains=chains, **common)


def test_a_sampled_request_replays_a_heads_chain_in_expectation(tree_policy, target_dir, head_dir):
    from speculation.models import StageRecord

    # given: the head drafting a chain (no tree), a sampled answer
    tree_policy.eagle_tree = {}
    tree_policy.save(update_fields=["eagle_tree"])
    output = _sampled_output(target_dir)
    want = _expected_chain(target_dir, head_dir, output)
    # when
    _shadow_sampled(tree_policy, "sampled-2", output)
    # then: the chain's expected counts (rounded on the record), its passes read per step start and depth
    record = StageRecord.objects.get(request_id="sampled-2")
    assert "the head's chain expected" in record.reason and record.multiplier is not None, record.reason
    assert record.target_passes == round(want.target_passes) and record.drafted_tokens == round(want.drafted_tokens)
    assert record.mean_accepted_len == pytest.approx(want.mean_accepted_len, abs=1e-3)
    assert 1.0 < want.mean_accepted_len < K + 1  # the head's drafts pass sometimes, not always


def _target_is_the_served_model(monkeypatch) -> None:
    """The tiny target stands for the endpoint's served model (identity checks: test_target_identity.py)."""
    from speculation.services import target_identity

    monkeypatch.setattr(target_identity, "check", lambda **kwargs: target_identity.Identity(""))


def test_candidate_replays_replay_an_eagle_head_as_the_policys_tree(tree_policy, target_dir, head_dir, monkeypatch):
    from speculation.models import CandidateMeasurement
    from speculation.worker import candidates

    # given: the candidates of a tree policy's request (the head is one: the worker holds its target)
    monkeypatch.setattr(candidates, "_costs", lambda *args: MEASURED)
    _target_is_the_served_model(monkeypatch)
    tree_policy.endpoint.capabilities = {"tokenizer_fingerprint": "tiny"}
    tree_policy.endpoint.save(update_fields=["capabilities"])
    tree_policy.draft.tokenizer_fingerprint = "tiny"
    tree_policy.draft.save(update_fields=["tokenizer_fingerprint"])
    output = _output(target_dir)
    tree, chain = _replays(target_dir, head_dir, output)
    # when
    candidates.measure_candidates(endpoint=tree_policy.endpoint, policy=tree_policy, request_id="cand-tree",
                                  workload="chat", prompt_ids=PROMPT, output_ids=output, max_tokens=len(output),
                                  budgeted=False)  # fmt: skip
    # then: the head's row at K is the tree's replay, with the tree's cost
    row = CandidateMeasurement.objects.get(request_id="cand-tree", candidate="tiny-head")
    assert row.status == "measured" and "draft tree" in row.reason, row.reason
    assert row.counts[K - 1] == [tree.drafted_tokens, tree.accepted_tokens, tree.target_passes]
    assert row.counts[K - 1] != [chain.drafted_tokens, chain.accepted_tokens, chain.target_passes]
    k_mean = tree.drafted_tokens / tree.target_passes
    want = MEASURED.multiplier(tokens_per_step=tree.tokens_per_pass, k=k_mean, verified=k_mean * 12 / 4)
    assert row.multiplier[K - 1] == pytest.approx(want, abs=1e-4)


def test_candidate_replays_of_a_sampled_request_replay_the_heads_tree(tree_policy, target_dir, head_dir, monkeypatch):
    from speculation.models import CandidateMeasurement
    from speculation.worker import candidates

    # given: a sampled request of a tree policy whose head is a candidate (the worker holds its target)
    monkeypatch.setattr(candidates, "_costs", lambda *args: MEASURED)
    _target_is_the_served_model(monkeypatch)
    tree_policy.endpoint.capabilities = {"tokenizer_fingerprint": "tiny"}
    tree_policy.endpoint.save(update_fields=["capabilities"])
    tree_policy.draft.tokenizer_fingerprint = "tiny"
    tree_policy.draft.save(update_fields=["tokenizer_fingerprint"])
    output = _sampled_output(target_dir, seed=3)
    tree, _chain = _replays(target_dir, head_dir, output)
    # when
    candidates.measure_candidates(endpoint=tree_policy.endpoint, policy=tree_policy, request_id="cand-sampled",
                                  workload="chat", prompt_ids=PROMPT, output_ids=output, max_tokens=len(output),
                                  sampling={"temperature": 0.7, "top_k": 0, "top_p": 0.9}, budgeted=False)  # fmt: skip
    # then: the head's row at K is the tree's replay against the sampled output
    row = CandidateMeasurement.objects.get(request_id="cand-sampled", candidate="tiny-head")
    assert row.status == "measured" and "sampled" in row.reason and "draft tree" in row.reason, row.reason
    assert row.counts[K - 1] == [tree.drafted_tokens, tree.accepted_tokens, tree.target_passes]
    # and without a tree the head's row is its chain in expectation
    tree_policy.eagle_tree = {}
    tree_policy.save(update_fields=["eagle_tree"])
    candidates.measure_candidates(endpoint=tree_policy.endpoint, policy=tree_policy, request_id="cand-chain",
                                  workload="chat", prompt_ids=PROMPT, output_ids=output, max_tokens=len(output),
                                  sampling={"temperature": 0.7, "top_k": 0, "top_p": 0.9}, budgeted=False)  # fmt: skip
    chain = CandidateMeasurement.objects.get(request_id="cand-chain", candidate="tiny-head")
    want = _expected_chain(target_dir, head_dir, output)
    assert chain.status == "measured" and "the head's chain expected" in chain.reason, chain.reason
    assert chain.mean_accepted_len[K - 1] == pytest.approx(want.mean_accepted_len, abs=1e-3)
