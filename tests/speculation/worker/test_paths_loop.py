"""The greedy draft -> verify loop and its replay: the replay is exact (equal step by step), and agrees with
the engine's replay_greedy on the counts both keep."""

from __future__ import annotations

import random

import pytest

from speculation.engine import replay_greedy
from speculation.worker.paths import SpecRunStats
from speculation.worker.paths.loop import commit, greedy_speculate, replay_greedy_batches

EOS = 0


class TableModel:
    """A deterministic "model": the next token is a fixed function of the last two tokens (vocab 1..9, EOS 0)."""

    def __init__(self, seed: int, eos_rate: float = 0.05) -> None:
        rng = random.Random(seed)
        self.table = {
            (a, b): (EOS if rng.random() < eos_rate else rng.randint(1, 9)) for a in range(10) for b in range(10)
        }

    def next(self, context: list[int]) -> int:
        return self.table[(context[-2], context[-1])]


class Proposer:
    def __init__(self, model: TableModel) -> None:
        self.model = model

    def propose(self, context: list[int], k: int) -> list[int]:
        out: list[int] = []
        for _ in range(k):
            out.append(self.model.next(context + out))
        return out


class Verifier:
    def __init__(self, model: TableModel) -> None:
        self.model = model

    def verify(self, context: list[int], drafts: list[int]) -> tuple[int, int]:
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == self.model.next(context + drafts[:accepted]):
            accepted += 1
        return accepted, self.model.next(context + drafts[:accepted])


def _plain(target: TableModel, prompt: list[int], max_tokens: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_tokens:
        out.append(target.next(prompt + out))
        if out[-1] == EOS:
            break
    return out


@pytest.mark.parametrize("seed", range(40))
def test_speculation_is_greedy_exact_and_the_replay_equals_it_step_by_step(seed):
    rng = random.Random(seed)
    target, draft = TableModel(seed), TableModel(seed)
    # the draft agrees with the target on about 70% of contexts
    for key in draft.table:
        if rng.random() < 0.3:
            draft.table[key] = rng.randint(0, 9)
    prompt = [rng.randint(1, 9) for _ in range(rng.randint(2, 6))]
    max_tokens, k = rng.randint(1, 40), rng.randint(1, 6)
    batches = list(
        greedy_speculate(
            proposer=Proposer(draft),
            verifier=Verifier(target),
            prompt_ids=prompt,
            max_tokens=max_tokens,
            k=k,
            eos_ids=frozenset({EOS}),
        )
    )
    output = [t for b in batches for t in b.ids]
    assert output == _plain(target, prompt, max_tokens)
    draft_next = [draft.next(prompt + output[:i]) for i in range(len(output))]
    replayed = list(
        replay_greedy_batches(
            draft_next=draft_next, output_ids=output, max_tokens=max_tokens, k=k, stopped=output[-1] == EOS
        )
    )
    assert replayed == batches
    # the engine's replay counts the same drafted / accepted tokens and verification steps
    stats = SpecRunStats(k=k)
    for batch in batches:
        stats.add(batch)
    engine_next = [draft.next((prompt + output)[: i + 1]) if i + 1 >= 2 else 0 for i in range(len(prompt + output))]
    engine = replay_greedy(engine_next, prompt + output, k, prompt_len=len(prompt), max_new_tokens=max_tokens)
    assert (engine.drafted_tokens, engine.accepted_tokens) == (stats.drafted, stats.accepted)
    assert engine.target_passes == stats.passes


def test_a_batch_is_cut_after_an_accepted_end_of_sequence_token():
    batch = commit([5, EOS, 7], accepted=3, target_token=8, eos_ids=frozenset({EOS}))
    assert (batch.ids, batch.accepted, batch.finished) == ([5, EOS], 2, True)


def test_stats_name_what_they_count():
    stats = SpecRunStats(k=3)
    for batch in [commit([1, 2, 3], 3, 4, frozenset()), commit([1, 2, 3], 1, 9, frozenset())]:
        stats.add(batch)
    record = stats.as_record()
    assert record["acceptance_rate"] == pytest.approx(4 / 6)  # accepted / drafted (vLLM's metric)
    assert record["alpha"] == pytest.approx(4 / 5)  # accepted / checked (3 + 2: the 2nd step stopped at 2)
    assert record["mean_accepted_len"] == pytest.approx(6 / 2)  # tokens per verification, bonus included
    assert record["per_position_acceptance"] == [1.0, 0.5, 0.5]
    assert record["accepted_length_hist"] == [0, 1, 0, 1]
