"""Draft trees (speculation/engine/tree.py): one target pass over a tree mask scores every node as its own
path would, the cache keeps only the accepted path, and verification is exact (greedy: token-identical to plain
decoding; sampling: distributed as the target, checked by a chi-square test that also rejects a wrong sampler).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from speculation.engine import (
    DynamicLookahead,
    GenerationConfig,
    LocalTarget,
    generate,
    generate_plain,
    verify_greedy,
)
from speculation.engine import tree as tree_module
from speculation.engine.eagle import EagleHead, EagleProposer
from speculation.engine.sampling import SamplingParams, probs_from_logits
from speculation.engine.tree import (
    DraftTree,
    TreeShape,
    TreeShapeError,
    replay_tree_greedy,
    verify_tree_greedy,
    verify_tree_sampled,
)
from tests.support.eagle import head_for


def random_tree(size: int, vocab: int, generator: torch.Generator) -> DraftTree:
    """A random tree in topological order (each row's parent is an earlier row)."""
    parents = torch.tensor([int(torch.randint(0, row, (1,), generator=generator)) for row in range(1, size + 1)])
    depths = torch.zeros(size + 1, dtype=torch.long)
    for row in range(1, size + 1):
        depths[row] = depths[parents[row - 1]] + 1
    tokens = torch.randint(0, vocab, (size,), generator=generator)
    return DraftTree.build(tokens, parents, depths[1:], int(depths.max()))


def path_rows(tree: DraftTree, row: int) -> list[int]:
    """The rows from the root's child down to ``row``."""
    rows = []
    while row:
        rows.append(row)
        row = int(tree.parents[row - 1])
    return rows[::-1]


def tree_pass(model, prefix: list[int], tree: DraftTree):
    """The target after prefix[:-1], then one pass over [prefix[-1], tree] with the tree mask."""
    model.setup_cache(model.max_len)
    start = len(prefix) - 1
    model(torch.tensor(prefix[:-1]), 0)
    tokens = torch.cat([torch.tensor(prefix[-1:]), tree.tokens])
    mask = torch.cat([torch.ones(tree.size + 1, start, dtype=torch.bool), tree.ancestors], dim=1)
    return model(tokens, start, positions=start + tree.row_depths, mask=mask).logits.clone()


# --- the tree pass and the cache -------------------------------------------------------------------------------


def test_one_tree_pass_scores_every_node_as_a_pass_over_its_own_path_would(target_model):
    # given a random 12-node tree after an 9-token prefix
    prefix = [3, 17, 4, 40, 2, 9, 33, 21, 8]
    tree = random_tree(12, target_model.vocab_size, torch.Generator().manual_seed(0))
    assert tree.depth >= 3  # the test covers branches and depth

    # when the target scores the whole tree in one pass
    logits = tree_pass(target_model, prefix, tree)

    # then each row equals a plain causal pass over the prefix and that row's path
    for row in range(tree.size + 1):
        path = [int(tree.tokens[r - 1]) for r in path_rows(tree, row)]
        target_model.setup_cache(target_model.max_len)
        want = target_model(torch.tensor(prefix + path), 0).logits[-1]
        torch.testing.assert_close(logits[row], want, atol=1e-4, rtol=1e-4)


def test_an_explicit_causal_mask_and_positions_give_the_chain_pass_exactly(target_model):
    tokens, start = torch.tensor([5, 6, 7, 8]), 3
    target_model.setup_cache(target_model.max_len)
    target_model(torch.tensor([1, 2, 3]), 0)
    chain = target_model(tokens, start).logits.clone()
    mask = torch.ones(4, start + 4, dtype=torch.bool).tril(diagonal=start)

    explicit = target_model(tokens, start, positions=torch.arange(start, start + 4), mask=mask).logits

    torch.testing.assert_close(explicit, chain, atol=0, rtol=0)


def test_keeping_the_accepted_path_leaves_the_cache_as_if_only_the_path_was_processed(target_model):
    # given a tree pass, then only the path to a deep row is kept in the cache
    prefix = [3, 17, 4, 40, 2]
    tree = random_tree(10, target_model.vocab_size, torch.Generator().manual_seed(1))
    tree_pass(target_model, prefix, tree)
    deepest = int(tree.row_depths.argmax())
    rows = path_rows(tree, deepest)
    start = len(prefix) - 1
    target_model.keep_cache_slots(torch.tensor(rows) + start, start + 1)

    # when the next token is processed after the kept path
    path = [int(tree.tokens[r - 1]) for r in rows]
    got = target_model(torch.tensor([11]), start + 1 + len(rows)).logits[-1].clone()

    # then it is what a pass over prefix + path + that token gives
    target_model.setup_cache(target_model.max_len)
    want = target_model(torch.tensor(prefix + path + [11]), 0).logits[-1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# --- verification rules ----------------------------------------------------------------------------------------


def test_greedy_verification_of_a_chain_tree_is_the_chain_verification():
    generator = torch.Generator().manual_seed(2)
    for _ in range(50):
        logits = torch.randn(5, 7, generator=generator)
        best = logits.argmax(-1)
        drafts = torch.where(torch.rand(4, generator=generator) < 0.7, best[:4], torch.randint(0, 7, (4,)))

        want_accepted, want_tokens = verify_greedy(drafts, logits)
        accepted, rows, tokens = verify_tree_greedy(DraftTree.chain(drafts), logits)

        assert int(accepted) == int(want_accepted)
        assert tokens[: int(accepted) + 1].tolist() == want_tokens[: int(accepted) + 1].tolist()
        assert rows[: int(accepted) + 1].tolist() == list(range(int(accepted) + 1))


def test_greedy_verification_commits_the_branch_the_target_agrees_with():
    # given root -> {row 1: token 4, row 2: token 5}; row 2 -> row 3: token 6; row 1 -> row 4: token 6
    tree = DraftTree.build(torch.tensor([4, 5, 6, 6]), torch.tensor([0, 0, 2, 1]), torch.tensor([1, 1, 2, 2]), 2)
    logits = torch.full((5, 8), -5.0)
    logits[0, 5] = logits[2, 6] = logits[3, 2] = logits[1, 6] = 5.0  # the target: 5, then 6, then 2

    accepted, rows, tokens = verify_tree_greedy(tree, logits)

    assert int(accepted) == 2
    assert rows[:3].tolist() == [0, 2, 3]
    assert tokens[:3].tolist() == [5, 6, 2]  # two accepted drafts, then the bonus token


def test_replaying_a_tree_against_the_targets_known_output_is_verifying_it():
    """Shadow replay: a greedy target's known output decides a tree exactly as its logits do (no target pass)."""
    generator = torch.Generator().manual_seed(4)
    checked = 0
    for trial in range(400):
        tree = random_tree(int(torch.randint(1, 12, (1,), generator=generator)), 6, generator)
        siblings = list(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True))
        if len(set(siblings)) < len(siblings):
            continue  # the expansion never gives two siblings one token (the replay needs distinct siblings)
        logits = torch.randn(tree.size + 1, 6, generator=generator)
        logits[:, :3] += 2.0  # the target prefers tokens the drafts often carry: paths get long
        accepted, rows, tokens = verify_tree_greedy(tree, logits)
        # the known output: the argmax along the accepted path, then what the target said after it
        path = [0, *rows[1 : int(accepted) + 1].tolist()]
        known = torch.tensor([int(logits[row].argmax()) for row in path])
        if trial % 2:  # a longer output: tokens past the path do not change the verdict
            known = torch.cat([known, torch.randint(0, 6, (3,), generator=generator)])

        replayed, replay_rows, replay_tokens = replay_tree_greedy(tree, known)

        assert int(replayed) == int(accepted)
        assert replay_rows[: int(accepted) + 1].tolist() == rows[: int(accepted) + 1].tolist()
        assert replay_tokens[: int(accepted) + 1].tolist() == tokens[: int(accepted) + 1].tolist()
        checked += 1
    assert checked >= 50, checked


def test_a_replayed_tree_stops_at_the_end_of_the_known_output():
    tree = DraftTree.chain(torch.tensor([3, 1, 2]))
    accepted, _, tokens = replay_tree_greedy(tree, torch.tensor([3, 1]))
    assert int(accepted) == 2 and tokens[:3].tolist() == [3, 1, -1]


def test_a_tree_shape_out_of_range_is_refused():
    for bad in ({"top_k": 0}, {"depth": 17}, {"nodes": 65}, {"top_k": 2.5}):
        with pytest.raises(TreeShapeError):
            TreeShape(**bad)


# --- expansion with an EAGLE head ------------------------------------------------------------------------------


def primed_proposer(model, prompt: list[int], **kwargs) -> EagleProposer:
    """A proposer whose drafter has the prompt's true features queued (as after a prefill)."""
    proposer = EagleProposer(head_for(model), model, **kwargs)
    proposer.begin(prompt)
    model.setup_cache(model.max_len)
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt[:-1]), 0, return_hidden=True).hidden
    proposer.observe_target(hidden, hidden.shape[0] - 1)
    return proposer


def test_the_expansion_keeps_a_tree_of_distinct_siblings_closed_under_ancestors(target_model):
    prompt = [3, 17, 4, 40, 2, 9]
    proposer = primed_proposer(target_model, prompt, tree=TreeShape(top_k=3, depth=4, nodes=14))

    tree = proposer.propose(prompt, 4, SamplingParams(), None).tree

    assert tree.size == 14
    parents, depths = tree.parents.tolist(), tree.row_depths.tolist()
    for row in range(1, 15):
        assert parents[row - 1] < row  # topological
        assert depths[row] == depths[parents[row - 1]] + 1
    siblings = {}
    for row, (parent, token) in enumerate(zip(parents, tree.tokens.tolist(), strict=True), start=1):
        assert token not in siblings.setdefault(parent, set()), f"row {row} repeats a sibling's token"
        siblings[parent].add(token)
    assert max(depths) == 4


def test_a_one_wide_tree_is_the_heads_greedy_chain(target_model):
    prompt = [3, 17, 4, 40, 2, 9]
    chain = primed_proposer(target_model, prompt).propose(prompt, 5, SamplingParams(), None).tokens
    one_wide = primed_proposer(target_model, prompt, tree=TreeShape(top_k=1, depth=5, nodes=5))

    tree = one_wide.propose(prompt, 5, SamplingParams(), None).tree

    assert tree.tokens.tolist() == chain.tolist()
    assert tree.parents.tolist() == [0, 1, 2, 3, 4]


# --- exactness in the decode loop ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_tree_head(target_model, tmp_path_factory) -> EagleHead:
    """A head trained briefly on the target's own greedy continuations, so that its drafts are often accepted."""
    from tests.support.eagle import trained_head

    return trained_head(target_model, head_for(target_model), tmp_path_factory.mktemp("tree-head"))


PROMPTS = [[3, 9, 27, 1], [5], [40, 2, 2, 2, 41, 7, 19, 33, 8], list(range(20))]
SHAPES = [TreeShape(top_k=1, depth=4, nodes=4), TreeShape(top_k=3, depth=4, nodes=12), TreeShape(4, 6, 24)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"k{s.top_k}-d{s.depth}-n{s.nodes}")
def test_tree_greedy_output_is_token_identical_to_plain_greedy(target_model, trained_tree_head, shape):
    local = LocalTarget(target_model)
    proposer = EagleProposer(trained_tree_head, target_model, tree=shape)
    accepted = 0
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=40, k=shape.depth)
        plain = generate_plain(local, prompt, config).tokens

        result = generate(local, proposer, prompt, config)

        assert result.tokens == plain, f"prompt {prompt}"
        accepted += result.stats.accepted_tokens
    assert accepted > 0  # the accept path (and the cache compaction behind it) was exercised


def test_tree_greedy_honours_stop_tokens_and_min_tokens(target_model, trained_tree_head):
    local = LocalTarget(target_model)
    proposer = EagleProposer(trained_tree_head, target_model, tree=TreeShape(3, 4, 12))
    prompt = PROMPTS[2]
    free = generate_plain(local, prompt, GenerationConfig(max_new_tokens=30)).tokens
    stop = free[9]
    config = GenerationConfig(max_new_tokens=30, k=4, stop_token_ids=(stop,), min_tokens=12, suppress_ids=(stop,))

    result = generate(local, proposer, prompt, config)

    assert result.tokens == generate_plain(local, prompt, config).tokens
    assert stop not in result.tokens[:12]


def test_dynamic_lookahead_sizes_the_trees_depth_and_the_output_stays_plain(target_model, trained_tree_head):
    # given the lookahead controller choosing K each step: for a tree proposer K caps the tree's depth, and the
    # controller's measured costs (verify time per depth, draft time per level) are the tree's own
    local = LocalTarget(target_model)
    proposer = EagleProposer(trained_tree_head, target_model, tree=TreeShape(3, 6, 12))
    lookahead = DynamicLookahead(k_max=6, k_start=6)
    config = GenerationConfig(max_new_tokens=40, k=6, dynamic_k=True)
    depths: set[int] = set()

    for prompt in PROMPTS:
        result = generate(local, proposer, prompt, config, lookahead=lookahead)

        assert result.tokens == generate_plain(local, prompt, config).tokens
        depths.update(result.k_history)
    assert len(depths) > 1  # the controller tried more than one tree depth
    assert max(depths) <= 6


def test_a_tree_accepts_at_least_as_much_as_the_chain_on_the_trained_head(target_model, trained_tree_head):
    local = LocalTarget(target_model)
    config = GenerationConfig(max_new_tokens=60, k=5)

    def mean_accepted(proposer) -> float:
        stats = [generate(local, proposer, prompt, config).stats for prompt in PROMPTS]
        return sum(s.accepted_tokens + s.drafts for s in stats) / sum(s.drafts for s in stats)

    chain = mean_accepted(EagleProposer(trained_tree_head, target_model))
    tree = mean_accepted(EagleProposer(trained_tree_head, target_model, tree=TreeShape(4, 5, 24)))

    # a 24-node tree holds the head's top-1 chain in all but rare steps, so it cannot do worse by more than noise
    assert tree >= chain - 0.05, (tree, chain)


@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: f"k{s.top_k}-d{s.depth}-n{s.nodes}")
def test_replaying_a_tree_on_the_known_output_counts_what_the_live_tree_run_did(target_model, trained_tree_head, shape):
    # given: the live tree run on the target, and the target's features of its own greedy output (shadow's view)
    from speculation.engine.replay import replay_proposer

    local = LocalTarget(target_model)
    tree_accepted = chain_accepted = 0
    for prompt in PROMPTS:
        config = GenerationConfig(max_new_tokens=40, k=shape.depth)
        live = generate(local, EagleProposer(trained_tree_head, target_model, tree=shape), prompt, config)
        sequence = prompt + live.tokens
        with torch.inference_mode():
            hidden = target_model(torch.tensor(sequence), 0, return_hidden=True).hidden
        # when: the tree is replayed against the known output (no target pass per step)
        replayed = replay_proposer(
            EagleProposer(trained_tree_head, target_model, tree=shape), sequence, shape.depth,
            prompt_len=len(prompt), hidden=hidden,
        )  # fmt: skip
        chain = replay_proposer(
            EagleProposer(trained_tree_head, target_model), sequence, shape.depth, prompt_len=len(prompt), hidden=hidden
        )
        # then: the same steps, drafts and acceptances as the live run, and not the chain's
        got = (replayed.target_passes, replayed.drafted_tokens, replayed.accepted_tokens)
        assert got == (live.stats.target_passes, live.stats.drafted_tokens, live.stats.accepted_tokens), prompt
        assert replayed.alpha_per_position == live.stats.alpha_per_position
        tree_accepted, chain_accepted = tree_accepted + replayed.accepted_tokens, chain_accepted + chain.accepted_tokens
    assert tree_accepted > chain_accepted  # the replay verified the tree, not the head's chain


def test_tree_sampling_with_a_seed_is_reproducible(target_model):
    local = LocalTarget(target_model)
    proposer = EagleProposer(head_for(target_model), target_model, tree=TreeShape(3, 3, 9))

    def run(seed: int) -> list[int]:
        config = GenerationConfig(max_new_tokens=30, k=3, temperature=1.0, top_p=0.95, seed=seed)
        return generate(local, proposer, [1, 2, 3], config).tokens

    assert run(7) == run(7)
    assert run(7) != run(8)


# --- sampling: the output is distributed as the target's -------------------------------------------------------

P_VALUE_FLOOR = 1e-3
SAMPLES = 3000
NEW_TOKENS = 3


def exact_joint(model, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple, float]:
    """The target's exact distribution of its next n tokens, by enumeration."""
    joint: dict[tuple, float] = {}
    for seq in itertools.product(range(model.vocab_size), repeat=n):
        model.setup_cache(model.max_len)
        with torch.inference_mode():
            logits = model(torch.tensor(prompt + list(seq)), 0).logits[len(prompt) - 1 : -1]
        p = probs_from_logits(logits, params)
        joint[seq] = float(p[torch.arange(n), torch.tensor(seq)].prod())
    return joint


def chi_square_p_value(counts: dict[tuple, int], expected: dict[tuple, float], n: int) -> float:
    """Pearson chi-square goodness of fit; cells expected below 5 are pooled into one (Wilson-Hilferty tail)."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in expected.items():
        e, o = p * n, counts.get(cell, 0)
        if e < 5:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
            continue
        stat += (o - e) ** 2 / e
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def residual_ignoring_the_children(tree, p, generator):
    """A classic multi-draft bug: when every child is rejected, draw the recovered token from p itself."""
    num_accepted, rows, tokens = verify_tree_sampled(tree, p, generator)
    last = rows[int(num_accepted)]
    wrong = torch.multinomial(p[last], 1, generator=generator)
    return num_accepted, rows, torch.where(torch.arange(tokens.shape[0]) == num_accepted, wrong, tokens)


@pytest.mark.slow
def test_tree_sampling_follows_the_targets_exact_distribution_and_a_wrong_sampler_is_caught(
    monkeypatch, make_tiny_model
):
    """3,000 draws of the next 3 tokens over a 5-token vocabulary (125 cells) against the enumerated joint
    distribution: Pearson chi-square, a correct sampler fails with probability 1e-3 (the floor). The same
    test run with a sampler that ignores the rejected children in the recovered token must fail it (power).
    """
    model = make_tiny_model(vocab=5, dim=16, layers=1, seed=11, std=0.6)
    head = head_for(model, seed=12)  # untrained: its candidates are often rejected
    prompt = [1, 4, 2]
    params = SamplingParams(temperature=1.0)
    expected = exact_joint(model, prompt, NEW_TOKENS, params)
    local = LocalTarget(model)
    proposer = EagleProposer(head, model, tree=TreeShape(top_k=2, depth=3, nodes=6))

    def sample_counts() -> tuple[dict[tuple, int], int]:
        counts: dict[tuple, int] = {}
        rejected = 0
        for seed in range(SAMPLES):
            config = GenerationConfig(max_new_tokens=NEW_TOKENS, k=3, temperature=1.0, seed=seed)
            result = generate(local, proposer, prompt, config)
            counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
            rejected += result.stats.drafted_tokens - result.stats.accepted_tokens
        return counts, rejected

    counts, rejected = sample_counts()
    assert rejected > SAMPLES // 10  # the recovered-token path carried real weight
    assert chi_square_p_value(counts, expected, SAMPLES) > P_VALUE_FLOOR

    monkeypatch.setattr(tree_module, "verify_tree_sampled", residual_ignoring_the_children)
    wrong, _ = sample_counts()
    assert chi_square_p_value(wrong, expected, SAMPLES) < P_VALUE_FLOOR


# --- the demo pair and its trained head --------------------------------------------------------------------------


@pytest.mark.slow
def test_tree_greedy_on_the_demo_target_with_its_trained_head_equals_plain(demo_pair):
    """Skipped where no head was trained for the demo target ($ACE_HOME/models/<demo>-eagle, train_eagle)."""
    from speculation.engine import load_causal_lm
    from speculation.offline.eagle.demo_head import default_head_dir

    head_dir = default_head_dir(demo_pair)
    if not (head_dir / "config.json").is_file():
        pytest.skip(f"no EAGLE head trained for the demo target at {head_dir}")
    model = load_causal_lm(demo_pair.target_dir, max_len=512)
    local = LocalTarget(model)
    prompts = [[5, 300, 41, 1200, 17, 9, 88], list(range(100, 140)), [7, 7, 7, 250, 1024, 3]]
    accepted = 0
    for shape in (TreeShape(2, 8, 12, score_temperature=0.3), TreeShape(4, 6, 24, score_temperature=0.3)):
        proposer = EagleProposer.from_dir(head_dir, model, target_dir=demo_pair.target_dir, tree=shape)
        for prompt in prompts:
            config = GenerationConfig(max_new_tokens=48, k=shape.depth)

            result = generate(local, proposer, prompt, config)

            assert result.tokens == generate_plain(local, prompt, config).tokens, (shape, prompt)
            accepted += result.stats.accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: f"k{s.top_k}-d{s.depth}-n{s.nodes}")
def test_a_sampled_tree_run_is_replayed_exactly_against_its_sampled_output(target_model, trained_tree_head, shape):
    # a tree's candidates are the head's top-k (one-hot drafts): at a node a child passes exactly when the token
    # sampled there is that child, so the replay against the sampled output (shadow's) counts what the run did
    from speculation.engine.replay import replay_proposer

    local = LocalTarget(target_model)
    accepted = 0
    for seed, prompt in enumerate(PROMPTS * 2):
        config = GenerationConfig(max_new_tokens=40, k=shape.depth, temperature=0.8, top_p=0.95, seed=seed)
        live = generate(local, EagleProposer(trained_tree_head, target_model, tree=shape), prompt, config)
        sequence = prompt + live.tokens
        with torch.inference_mode():
            hidden = target_model(torch.tensor(sequence), 0, return_hidden=True).hidden
        replayed = replay_proposer(
            EagleProposer(trained_tree_head, target_model, tree=shape), sequence, shape.depth,
            prompt_len=len(prompt), hidden=hidden, max_new_tokens=40,
        )  # fmt: skip
        assert replayed.counts() == live.stats.counts(), (seed, prompt)
        accepted += live.stats.accepted_tokens
    assert accepted > 0
