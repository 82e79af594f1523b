"""EAGLE training: deterministic with a seed, resumable after a crash, progress on the TrainingRun row, a
registered eagle_head draft, the management command and the Celery task on the GPU queue."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
import torch
from django.core.management import call_command

from speculation.engine.eagle import EagleConfig, EagleHead, EagleProposer, init_weights
from speculation.models import DraftKind, TrainingRun, TrainingStatus
from speculation.offline.eagle.collect import Sequences
from speculation.offline.eagle.evaluate import ReplayStats, bootstrap_interval
from speculation.offline.eagle.pipeline import Progress
from speculation.offline.eagle.prompts import Prompt, PromptSourceError, read_prompts, split_prompts
from speculation.offline.eagle.train import CHECKPOINT, TrainingInterrupted, TrainSettings, train_head
from speculation.services.eagle_training import create_training_run, run_training, start_training_run


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def random_sequences(n: int, seed: int, vocab: int = 50, hidden: int = 16, length: int = 24) -> Sequences:
    generator = torch.Generator().manual_seed(seed)
    data = Sequences()
    for _ in range(n):
        data.tokens.append(torch.randint(0, vocab, (length,), generator=generator))
        data.features.append(torch.randn(length, hidden, generator=generator))
        data.prompt_lens.append(8)
        data.categories.append("random")
    return data


VOCAB, HIDDEN = 50, 16
EMBED = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(5))
LM_HEAD = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(6))
CONFIG = EagleConfig(hidden_size=HIDDEN, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
                     vocab_size=VOCAB, max_position_embeddings=64)  # fmt: skip


def train(work_dir: Path, *, seed: int = 0, epochs: int = 3, on_epoch=None) -> tuple[EagleHead, list]:
    head = EagleHead(CONFIG)
    settings = TrainSettings(epochs=epochs, batch_size=4, seed=seed, warmup_steps=2)
    reports = train_head(head, EMBED, LM_HEAD, random_sequences(12, 1), random_sequences(2, 2), settings,
                         work_dir=work_dir, on_epoch=on_epoch)  # fmt: skip
    return head, reports


def assert_same_weights(a: EagleHead, b: EagleHead) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_training_is_deterministic_with_a_seed(tmp_path):
    first, first_reports = train(tmp_path / "a", seed=4)
    second, second_reports = train(tmp_path / "b", seed=4)
    other, _ = train(tmp_path / "c", seed=5)

    assert_same_weights(first, second)
    assert [r.loss for r in first_reports] == [r.loss for r in second_reports]
    assert not torch.equal(first.fc.weight, other.fc.weight)


def test_an_interrupted_run_resumes_to_the_same_head(tmp_path):
    uninterrupted, _ = train(tmp_path / "whole")

    def crash_after_epoch_2(report) -> None:
        if report.epoch == 2:
            raise TrainingInterrupted("simulated crash")

    with pytest.raises(TrainingInterrupted):
        train(tmp_path / "crashed", on_epoch=crash_after_epoch_2)
    assert (tmp_path / "crashed" / CHECKPOINT).is_file()
    resumed, reports = train(tmp_path / "crashed")

    assert [r.epoch for r in reports] == [1, 2, 3]
    assert_same_weights(resumed, uninterrupted)


def test_each_epoch_reports_a_held_out_interval_around_its_estimate(tmp_path):
    _, reports = train(tmp_path, epochs=2)

    for report in reports:
        low, high = report.alpha_interval
        assert low <= report.alpha <= high
        low, high = report.mean_accepted_len_interval
        assert low <= report.mean_accepted_len <= high


def test_the_interval_resamples_whole_sequences():
    # given one sequence the head always gets right and one it never does: positions within a sequence are
    # not independent, so the interval must span most of [0, 1] rather than shrink with the position count
    k = 4
    right, wrong = ReplayStats(k), ReplayStats(k)
    right.position_reached, right.position_accepted = [100] * k, [100] * k
    wrong.position_reached, wrong.position_accepted = [100, 0, 0, 0], [0, 0, 0, 0]

    low, high = bootstrap_interval([right, wrong], "alpha")

    assert low < 0.2 and high == 1.0


def test_early_stopping_keeps_the_best_epochs_head(tmp_path):
    # given a run whose held-out acceptance cannot improve after epoch 1 (random data: nothing to learn)
    head = EagleHead(CONFIG)
    settings = TrainSettings(epochs=6, batch_size=4, seed=0, warmup_steps=2, patience=2)
    kept: dict[int, dict] = {}

    def remember(report) -> None:
        kept[report.epoch] = {name: t.clone() for name, t in head.state_dict().items()}

    reports = train_head(head, EMBED, LM_HEAD, random_sequences(12, 1), random_sequences(2, 2), settings,
                         work_dir=tmp_path, on_epoch=remember)  # fmt: skip

    # then it stopped `patience` epochs after its best one, and the head holds that epoch's weights
    best = reports[-1].best_epoch
    assert reports[-1].epoch == best + 2 < 6
    assert max(r.mean_accepted_len for r in reports) == next(r for r in reports if r.epoch == best).mean_accepted_len
    for name, tensor in head.state_dict().items():
        assert torch.equal(tensor, kept[best][name]), name


def test_training_further_starts_from_the_given_heads_weights(tmp_path):
    # given a trained head, and a run that cannot move the weights (learning rate 0)
    trained, _ = train(tmp_path / "first", epochs=2)
    start = {name: t.clone() for name, t in trained.state_dict().items()}
    frozen = TrainSettings(epochs=1, batch_size=4, seed=0, warmup_steps=2, lr=0.0)
    # when it trains from those weights, and from scratch
    further, scratch = EagleHead(CONFIG), EagleHead(CONFIG)
    train_head(further, EMBED, LM_HEAD, random_sequences(12, 3), random_sequences(2, 2), frozen,
               work_dir=tmp_path / "further", initial=start)  # fmt: skip
    train_head(scratch, EMBED, LM_HEAD, random_sequences(12, 3), random_sequences(2, 2), frozen,
               work_dir=tmp_path / "scratch")  # fmt: skip
    # then the first holds the trained head's weights, the second the seeded initialisation's
    assert_same_weights(further, trained)
    assert not torch.equal(scratch.fc.weight, trained.fc.weight)


def test_a_long_prompt_gives_its_first_tokens_too_with_both_ends():
    from speculation.offline.eagle.collect import _cut_prompts

    def tokenizer(text: str, add_special_tokens: bool) -> dict:
        return {"input_ids": [int(word) for word in text.split()]}

    long, short = Prompt("summarization", " ".join(map(str, range(10)))), Prompt("qa", "7 8")

    last_only = _cut_prompts(tokenizer, [long, short], 4, both_ends=False)
    both = _cut_prompts(tokenizer, [long, short], 4, both_ends=True)

    assert [ids for _, ids in last_only] == [[6, 7, 8, 9], [7, 8]]
    assert [ids for _, ids in both] == [[6, 7, 8, 9], [0, 1, 2, 3], [7, 8]]  # a short prompt once
    assert [p.category for p, _ in both] == ["summarization", "summarization", "qa"]


def test_the_targets_continuation_weighs_fully_and_its_context_by_context_weight():
    from speculation.offline.eagle.collect import TEXT_WINDOW
    from speculation.offline.eagle.train import position_weights

    data = random_sequences(2, 1, length=6)
    data.prompt_lens[0] = 3  # tokens x_0..x_2 prompt, x_3..x_5 generated
    data.categories[1] = TEXT_WINDOW

    # entry j weighs f_{j+1}, which drafts x_{j+2}: x_2 is prompt text, x_3, x_4 and x_5 the target's own
    assert position_weights(data, 0, 0.25).tolist() == [0.25, 1.0, 1.0, 1.0, 1.0]
    assert position_weights(data, 1, 0.25).tolist() == [0.25] * 5  # a teacher-forced window: all context
    assert position_weights(data, 0, 1.0).tolist() == [1.0] * 5


def test_the_weighted_loss_is_the_mean_over_the_positions_the_weights_select():
    from speculation.offline.eagle.train import _batches, losses

    data = random_sequences(2, 1)  # prompts of 8 tokens: entries 6.. predict the continuation
    settings = TrainSettings(token_weight=1.0)
    head = EagleHead(CONFIG)
    init_weights(head, torch.Generator().manual_seed(0))

    def loss(weight: float | None) -> float:
        ((tokens, features, weights),) = _batches(data, [0, 1], 2, 1.0 if weight is None else weight)
        if weight is None:  # a boolean mask of the continuation's positions only
            weights = torch.zeros_like(weights, dtype=torch.bool)
            weights[:, 6:] = True
        return losses(head, EMBED, LM_HEAD, tokens, features, weights, settings)[0].item()

    continuation_only, all_alike = loss(None), loss(1.0)
    assert loss(0.0) == pytest.approx(continuation_only, rel=1e-6)
    assert all_alike != pytest.approx(continuation_only, rel=1e-3)
    # (w S_context + S_continuation) / (w n_context + n_continuation) lies between its values at w = 0 and w = 1
    assert min(all_alike, continuation_only) < loss(0.5) < max(all_alike, continuation_only)
    with pytest.raises(ValueError, match="context_weight"):
        TrainSettings(context_weight=1.5)


def test_a_checkpoint_written_with_other_settings_is_refused(tmp_path):
    train(tmp_path, epochs=1)

    with pytest.raises(ValueError, match="other settings"):
        train(tmp_path, epochs=1, seed=9)


# --- prompts ---------------------------------------------------------------------------------------------------


def test_spec_bench_prompts_are_read_with_their_categories():
    prompts = read_prompts("spec_bench")

    assert len(prompts) == 480
    assert {"translation", "summarization", "qa", "math_reasoning", "rag", "coding"} <= {p.category for p in prompts}


def test_the_split_keeps_every_category_on_both_sides():
    prompts = [Prompt(c, f"{c} {i}") for c in ("a", "b", "c") for i in range(10)]

    train_prompts, held_out = split_prompts(prompts, held_out=0.2, min_held_out=1)

    assert {p.category for p in held_out} == {"a", "b", "c"}
    assert len(train_prompts) + len(held_out) == 30
    assert [p.text for p in held_out[:2]] == ["a 0", "a 1"]  # the first of each category: what the bench uses


def test_docstring_prompts_are_paragraph_starts_of_the_training_files_docstrings():
    from speculation.offline.demo.corpus import stdlib_corpus
    from speculation.offline.eagle.prompts import DOCSTRING_PROMPT_CHARS, DOCSTRING_PROMPTS

    prompts = read_prompts("docstrings")

    assert len(prompts) == DOCSTRING_PROMPTS
    assert {p.category for p in prompts} == {"prose"}
    assert all(0 < len(p.text) <= DOCSTRING_PROMPT_CHARS and "\n" not in p.text for p in prompts)
    assert len({p.text for p in prompts}) > 0.95 * len(prompts)  # spread over the files, not one docstring repeated
    # every prompt opens a paragraph of a training file's docstring (never a held-out file's)
    held_out = " ".join(stdlib_corpus().english_text(10_000_000, held_out=True).split())
    training = " ".join(stdlib_corpus().english_text(2_000_000, sources=("docstrings",)).split())
    assert all(p.text in training for p in prompts)
    assert sum(p.text in held_out for p in prompts) < 0.05 * len(prompts)  # a few generic sentences recur
    assert read_prompts("spec_bench,docstrings")[480:] == prompts  # mixes like any source


def test_a_text_file_gives_one_prompt_per_paragraph(tmp_path):
    (tmp_path / "p.txt").write_text("first prompt\nstill first\n\nsecond prompt\n")

    assert [p.text for p in read_prompts(str(tmp_path / "p.txt"))] == ["first prompt\nstill first", "second prompt"]


def test_a_missing_prompt_file_says_where_it_looked(tmp_path):
    with pytest.raises(PromptSourceError, match="nope.jsonl"):
        read_prompts(str(tmp_path / "nope.jsonl"))


# --- the service, the command, the task -------------------------------------------------------------------------

TINY_OPTIONS = {"max_prompts": 12, "new_tokens": 12, "held_out": 0.25, "batch_size": 4, "warmup_steps": 2}


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    words = "the quick brown fox jumps over the lazy dog".split()
    lines = [
        {"category": ("fox", "dog")[i % 2], "prompt": " ".join(words[i % 5 :] + words[: i % 5])} for i in range(12)
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    return path


class Interrupt(Progress):
    def epoch(self, report) -> None:
        raise TrainingInterrupted("simulated crash after epoch 1")


@pytest.mark.django_db
def test_a_run_records_progress_and_registers_its_head(tmp_path, tiny_model_dir, prompt_file):
    run = create_training_run(target_dir=str(tiny_model_dir), out_dir=str(tmp_path / "head"), name="tiny-head",
                              prompts=str(prompt_file), epochs=2, seed=3, options=TINY_OPTIONS)  # fmt: skip

    run = run_training(run=run)

    run.refresh_from_db()
    assert run.status == TrainingStatus.DONE
    assert (run.epoch, len(run.log)) == (2, 2)
    assert run.loss is not None and run.alpha is not None and run.mean_accepted_len >= 1.0
    assert set(run.log[0]) >= {"epoch", "loss", "feature_loss", "token_loss", "alpha", "mean_accepted_len"}
    draft = run.draft
    assert (draft.kind, draft.path, draft.target_name) == (
        DraftKind.EAGLE_HEAD,
        run.out_dir,
        f"{tiny_model_dir.parent.name}/{tiny_model_dir.name}",
    )
    assert draft.config["eagle"]["training_run"] == run.pk
    from speculation.engine import load_causal_lm

    EagleProposer.from_dir(Path(draft.path), load_causal_lm(tiny_model_dir), target_dir=tiny_model_dir)


@pytest.mark.django_db
def test_a_crashed_run_is_marked_failed_and_resumes_when_run_again(tmp_path, tiny_model_dir, prompt_file):
    run = create_training_run(target_dir=str(tiny_model_dir), out_dir=str(tmp_path / "head"), prompts=str(prompt_file),
                              epochs=2, options=TINY_OPTIONS)  # fmt: skip

    with pytest.raises(TrainingInterrupted):
        run_training(run=run, echo=Interrupt())
    run.refresh_from_db()
    assert (run.status, run.epoch) == (TrainingStatus.FAILED, 1)
    assert "simulated crash" in run.error

    resumed_epochs: list[int] = []

    class Record(Progress):
        def epoch(self, report) -> None:
            resumed_epochs.append(report.epoch)

    run = run_training(run=run, echo=Record())

    assert resumed_epochs == [2]  # epoch 1 came from the checkpoint
    assert (run.status, [e["epoch"] for e in run.log]) == (TrainingStatus.DONE, [1, 2])


@pytest.mark.django_db
def test_the_command_prints_progress_and_registers_the_head(tmp_path, tiny_model_dir, prompt_file):
    out = io.StringIO()

    args = ["--target", str(tiny_model_dir), "--out", str(tmp_path / "head"), "--prompts", str(prompt_file)]
    call_command("train_eagle", *args, "--epochs", "2", "--max-prompts", "12", "--new-tokens", "12", stdout=out)

    text = out.getvalue()
    assert "[collect]" in text and "epoch 1/2" in text and "epoch 2/2" in text
    assert "registered as draft" in text
    assert TrainingRun.objects.get().status == TrainingStatus.DONE


@pytest.mark.django_db
def test_a_multi_layer_run_trains_token_led_and_weights_can_be_set(tmp_path, tiny_model_dir):
    from speculation.offline.eagle.settings import MULTI_LAYER_WEIGHTS, PipelineSettings

    # --queue records the run and queues it once the row commits: this test's transaction never does, so nothing runs
    base = ["train_eagle", "--target", str(tiny_model_dir), "--queue", "--prompts", "stdlib"]
    call_command(*base, "--out", str(tmp_path / "a"), "--multi-layer", stdout=io.StringIO())
    call_command(*base, "--out", str(tmp_path / "b"), "--multi-layer", "--token-weight", "0.5",
                 "--context-weight", "0.3", stdout=io.StringIO())  # fmt: skip
    call_command(*base, "--out", str(tmp_path / "c"), stdout=io.StringIO())
    a, b, c = (PipelineSettings.from_dict(run.config).train for run in TrainingRun.objects.order_by("pk"))

    led = MULTI_LAYER_WEIGHTS
    assert (a.token_weight, a.feature_weight) == (led["token_weight"], led["feature_weight"]) == (1.0, 0.1)
    assert (b.token_weight, b.feature_weight, b.context_weight) == (0.5, led["feature_weight"], 0.3)
    assert (c.token_weight, c.feature_weight, c.context_weight) == (0.1, 1.0, 1.0)  # EAGLE-1's, unchanged


@pytest.mark.django_db
@pytest.mark.parametrize(
    "flag, says",
    [(("--context-weight", "1.5"), "context_weight"), (("--unroll", "9"), "unroll"),
     (("--max-prompt-tokens", "0"), "--max-prompt-tokens")],
)  # fmt: skip
def test_an_out_of_range_training_setting_exits_2_and_records_nothing(tmp_path, tiny_model_dir, flag, says):
    from django.core.management.base import CommandError

    args = ["--target", str(tiny_model_dir), "--out", str(tmp_path / "head"), *flag]
    with pytest.raises(CommandError, match=says) as raised:
        call_command("train_eagle", *args, stdout=io.StringIO())
    assert raised.value.returncode == 2
    assert not TrainingRun.objects.exists()


@pytest.mark.django_db
def test_a_run_for_a_directory_without_a_model_is_refused(tmp_path):
    from django.core.exceptions import ValidationError

    with pytest.raises(ValidationError, match="not a model directory"):
        create_training_run(target_dir=str(tmp_path), out_dir=str(tmp_path / "head"))


@pytest.mark.worker
@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_gpu_worker_trains_a_queued_run(celery_worker, tmp_path, tiny_model_dir, prompt_file):
    from django.db import transaction

    with transaction.atomic():
        run = start_training_run(target_dir=str(tiny_model_dir), out_dir=str(tmp_path / "head"),
                                 prompts=str(prompt_file), epochs=1, options=TINY_OPTIONS)  # fmt: skip

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        run.refresh_from_db()
        if run.status in (TrainingStatus.DONE, TrainingStatus.FAILED):
            break
        time.sleep(1)
    assert run.status == TrainingStatus.DONE, run.error or celery_worker.log_tail()
    assert run.draft is not None and run.draft.kind == DraftKind.EAGLE_HEAD
