"""python -m speculation.bench runs end to end and writes the JSON keys the issue lists."""

from __future__ import annotations

import json

import pytest

from speculation.bench import engine as bench
from speculation.bench import trees

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


@pytest.mark.slow
def test_quick_bench_writes_every_key_and_greedy_outputs_match(tmp_path, capsys):
    import torch

    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()  # the bench sets torch's (process-wide) thread count
    try:
        assert bench.main(["--quick", "--max-new-tokens", "6", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(out.read_text())
    assert set(TOP_KEYS) <= set(report)
    assert report["greedy_identical"] is True
    # EAGLE runs (a chain and the draft trees) join when a trained head for the demo target exists
    # ($ACE_HOME/models/<demo>-eagle).
    runs = {(r["mechanism"], r["k"]) for r in report["runs"]}
    eagle = {run for run in runs if run[0] in ("eagle", "eagle_tree")}
    if eagle:
        assert eagle == {("eagle", 5)} | {("eagle_tree", label) for label in trees.TREES_BY_LABEL}
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
        ("hf_plain", None),
        ("hf_assisted", 5),
    }
    assert {"code", "translation", "summarization", "qa", "math_reasoning", "rag"} <= set(report["categories"])
    assert "draft_model" in capsys.readouterr().out


def test_missing_questions_file_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--questions", str(tmp_path / "none.jsonl")])
