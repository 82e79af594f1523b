"""python -m speculation.bench runs end to end and writes the JSON keys it documents."""

from __future__ import annotations

import json

import pytest

from speculation.bench import engine as bench
from speculation.bench import trees
from speculation.engine.tree import TreeShape

TOP_KEYS = (
    "device",
    "alpha",
    "mean_accepted_len",
    "k",
    "c_draft",
    "v_verify",
    "tok_s_plain",
    "tok_s_spec",
    "tok_s_hf_assisted",
    "speedup_vs_plain",
    "speedup_vs_hf",
    "bound",
    "efficiency",
    "greedy_identical",
    "target_step_ms",
    "runs",
    "categories",
)


@pytest.fixture
def demo_head_dir(demo_pair, tmp_path):
    """An (untrained) EAGLE head saved for the demo target: the bench runs it like the trained one."""
    import torch

    from speculation.engine.eagle import EagleConfig, EagleHead, init_weights

    head = EagleHead(EagleConfig.for_target(demo_pair.target_dir))
    init_weights(head, torch.Generator().manual_seed(0))
    head.save(tmp_path / "head")
    return tmp_path / "head"


@pytest.mark.slow
def test_quick_bench_writes_every_key_and_greedy_outputs_match(tmp_path, capsys, demo_head_dir):
    import torch

    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()  # the bench sets torch's (process-wide) thread count
    try:
        argv = ["--quick", "--max-new-tokens", "6", "--eagle-head", str(demo_head_dir), "--json", str(out)]
        assert bench.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert set(TOP_KEYS) <= set(report)
    assert report["greedy_identical"] is True
    # the EAGLE head runs as a chain, as the draft trees, and as the tree the controller sizes (shape counts)
    runs = {(r["mechanism"], r["k"]) for r in report["runs"]}
    eagle = {run for run in runs if run[0] in ("eagle", "eagle_tree")}
    assert eagle == {("eagle", 5), ("eagle", "dynamic"), ("eagle_tree", "dynamic")} | {
        ("eagle_tree", k) for k in trees.TREES_BY_LABEL
    }
    dynamic = next(r for r in report["runs"] if r["k"] == "dynamic" and r["mechanism"] == "eagle_tree")
    assert set(dynamic["shapes_used"]) == {"chain", "k2-n6", "k2-n12"}
    assert sum(dynamic["shapes_used"].values()) > 0
    assert report["eagle_vs_draft"]["categories"] == len(report["categories"])
    assert report["model"]["eagle_head"]["format"] in (1, 2)  # which head ran, with its training figures
    assert all("eagle_tree:" + label in cat["mechanisms"] for label in trees.TREES_BY_LABEL
               for cat in report["categories"].values())  # fmt: skip
    assert runs - eagle == {
        ("plain", None),
        ("draft_model", 5),
        ("draft_model", "dynamic"),
        ("ngram", 5),
        ("ngram", "dynamic"),
        ("suffix", 5),
        ("suffix", "dynamic"),
        ("suffix_draft", 5),
        ("suffix_draft", 2),
        ("hf_plain", None),
        ("hf_assisted", 5),
    }
    assert {"code", "translation", "summarization", "qa", "math_reasoning", "rag"} <= set(report["categories"])
    assert "draft_model" in capsys.readouterr().out
    # suffix decoding drafted from the answers to the prompts before (the first prompt's run had none)
    suffix = next(r for r in report["runs"] if r["mechanism"] == "suffix" and r["k"] == 5)
    assert suffix["greedy_identical"] is True and suffix["acceptance_rate"] > 0
    hybrid = next(r for r in report["runs"] if r["mechanism"] == "suffix_draft")
    assert hybrid["greedy_identical"] is True and hybrid["acceptance_rate"] > 0


class _Built(Exception):
    pass


@pytest.mark.slow
def test_by_default_the_bench_builds_the_demo_head_when_it_is_missing(monkeypatch):
    # given: building the head is recorded (and stops the run: what follows is the test above)
    built = []

    def build(pair):
        built.append(pair.root.name)
        raise _Built

    monkeypatch.setattr(bench, "build_demo_head", build)
    # then: a plain run asks for the demo head (a no-op when it is cached)
    with pytest.raises(_Built):
        bench.main(["--quick", "--max-new-tokens", "2"])
    assert len(built) == 1


@pytest.mark.slow
def test_the_trees_asked_for_are_the_trees_run(tmp_path, demo_head_dir):
    import torch

    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    try:
        argv = ["--quick", "--max-new-tokens", "3", "--eagle-head", str(demo_head_dir), "--tree", "k3-d4-n7-t0.5"]
        assert bench.main([*argv, "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    tree_runs = {r["k"]: r for r in report["runs"] if r["mechanism"] == "eagle_tree"}
    assert set(tree_runs) == {"k3-d4-n7-t0.5", "dynamic"}
    assert tree_runs["k3-d4-n7-t0.5"]["tree"] == {"top_k": 3, "depth": 4, "nodes": 7, "score_temperature": 0.5}
    assert report["greedy_identical"] is True


@pytest.mark.parametrize("shape", ["k2-d6", "k2-d6-n0", "k9-d6-n10", "k2-d6-n10-t0"])
def test_a_bad_tree_shape_exits_2_saying_what_is_wrong(capsys, shape):
    with pytest.raises(SystemExit) as exited:
        bench.main(["--quick", "--tree", "k2-d6-n10", "--tree", shape])
    assert exited.value.code == 2
    assert repr(shape) in capsys.readouterr().err


def test_a_tree_label_reads_back_as_its_shape():
    for shape in trees.EAGLE_TREES:
        assert trees.parse_tree(trees.tree_label(shape)) == shape
    assert trees.parse_tree("k2-d6-n10") == TreeShape(top_k=2, depth=6, nodes=10, score_temperature=1.0)


def test_missing_questions_file_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--questions", str(tmp_path / "none.jsonl")])


@pytest.mark.parametrize(
    "module",
    [
        "speculation.bench",
        "speculation.bench.batching",
        "speculation.bench.eagle",
        "speculation.bench.families",
        "speculation.bench.gateway_overhead",
        "speculation.bench.gpu_check",
        "speculation.bench.looping",
        "speculation.bench.plain_path",
        "speculation.bench.sampled",
        "speculation.bench.sampled_replay",
    ],
)
def test_each_bench_command_starts_as_a_user_runs_it_without_django_settings(module):
    """``python -m <module> --help`` in a fresh process with no DJANGO_SETTINGS_MODULE: what the docs tell a user
    to type must not need the app registry to start."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()
