"""The automatic workload category: trained on Spec-Bench, stored as JSON, pure Python in the web process."""

from __future__ import annotations

import json

from speculation.offline.eagle.prompts import VENDORED_SPEC_BENCH, read_prompts
from speculation.offline.workload_classifier import evaluate, split, train
from speculation.workloads.classifier import CATEGORY_OF, MODEL_PATH, NaiveBayes, classify, looks_like_code, model

# A sanity floor, not a target: the stored model scores 0.94 on the held-out split (docs/BENCHMARKS.md); 8
# categories with the largest one at 28 % of the prompts, so 0.8 fails any model that learnt nothing useful
# while leaving room for a retrain on another seed (0.93-0.94 on seeds 0-2).
FLOOR = 0.8


def test_the_vendored_questions_are_spec_benchs_480_with_their_13_categories():
    rows = read_prompts(str(VENDORED_SPEC_BENCH))
    assert len(rows) == 480
    assert {row.category for row in rows} == set(CATEGORY_OF)


def test_the_stored_model_is_the_one_trained_on_the_training_split_and_beats_the_floor_held_out():
    rows = read_prompts(str(VENDORED_SPEC_BENCH))
    train_rows, held = split(rows, seed=0)
    assert len(train_rows) + len(held) == len(rows) and not {id(r) for r in train_rows} & {id(r) for r in held}
    retrained = train(train_rows)
    assert retrained.to_json() == json.loads(MODEL_PATH.read_text())  # the JSON in the repo is reproducible
    report = evaluate(model(), held)
    assert report["accuracy"] >= FLOOR


def test_a_model_that_learnt_nothing_falls_below_the_floor():
    # the floor has teeth: a model whose every token is uninformative predicts its largest class only
    rows = read_prompts(str(VENDORED_SPEC_BENCH))
    _, held = split(rows, seed=0)
    flat = NaiveBayes(priors={"math": -1.0, "qa": -2.0}, log_probs={}, unseen={"math": -5.0, "qa": -5.0})
    assert evaluate(flat, held)["accuracy"] < FLOOR


def test_source_code_is_code_and_prose_is_not():
    assert looks_like_code("def fibonacci(n):")
    assert looks_like_code("import os\nimport sys\n\n\ndef main():")
    assert looks_like_code("Write a C++ program to find the nth Fibonacci number using recursion.")
    assert looks_like_code('"""Record of phased-in incompatible language changes.\n\nEach line is of the form:\n')
    assert looks_like_code("#!/usr/bin/env python3\n# A comment about the script\nSome prose follows.")
    assert not looks_like_code("Who played anna in once upon a time?")
    assert classify("def fibonacci(n):") == "code"
    assert classify("Translate German to English: Der Hund schläft im Garten .") == "translation"
