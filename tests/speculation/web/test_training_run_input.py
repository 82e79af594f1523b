"""A training run's input: prompts from the named sources or a file under the model roots, bounded numbers, and no
unknown field ignored.

Why: the worker reads the prompt file, so a path outside the roots would read any file and the run's error tell
whether it exists (`/etc/shadow`); an unbounded epoch count books a GPU forever; a misspelt field dropped silently
trains with settings nobody asked for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from speculation.models import TrainingRun
from speculation.services import eagle_training

pytestmark = pytest.mark.django_db

RUNS = "/api/v1/training-runs/"


@pytest.fixture
def root(settings, tmp_path, tiny_model_dir) -> Path:
    models = (tmp_path / "models").resolve()
    models.mkdir()
    settings.MODEL_ROOTS = [models, Path(tiny_model_dir).resolve()]
    return models


def _post(api, tiny_model_dir, root, **fields):
    body = {"target_dir": str(tiny_model_dir), "out_dir": str(root / "head"), **fields}
    return api.post(RUNS, body, format="json")


def test_a_prompt_file_outside_the_model_roots_is_refused_alike_whether_it_exists_or_not(api, tiny_model_dir, root):
    answers = [_post(api, tiny_model_dir, root, prompts=p) for p in ("/etc/shadow", "/etc/passwd", "/no/such/file")]

    assert [a.status_code for a in answers] == [400, 400, 400]
    messages = {a.json()["prompts"][0] for a in answers}
    assert len(messages) == 1, messages
    assert "model roots" in messages.pop()
    assert not TrainingRun.objects.exists()


def test_a_prompt_source_mixing_a_name_and_a_foreign_file_is_refused(api, tiny_model_dir, root):
    response = _post(api, tiny_model_dir, root, prompts="spec_bench,/etc/shadow")

    assert response.status_code == 400 and "prompts" in response.json()


def test_a_prompt_file_under_the_roots_is_accepted_and_the_named_sources_too(api, tiny_model_dir, root):
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "def f():"}\n')

    from_file = _post(api, tiny_model_dir, root, prompts=str(prompts))
    named = _post(api, tiny_model_dir, root, prompts="spec_bench,stdlib,docstrings")

    assert (from_file.status_code, named.status_code) == (201, 201), (from_file.content, named.content)
    assert TrainingRun.objects.filter(prompts=str(prompts)).exists()


def test_a_prompt_file_that_is_too_large_or_missing_under_the_roots_is_a_400(api, tiny_model_dir, root, monkeypatch):
    big = root / "big.txt"
    big.write_bytes(b"x" * 2048)
    monkeypatch.setattr(eagle_training, "PROMPTS_MAX_BYTES", 1024)

    too_large = _post(api, tiny_model_dir, root, prompts=str(big))
    missing = _post(api, tiny_model_dir, root, prompts=str(root / "nope.jsonl"))

    assert too_large.status_code == 400 and "1024" in too_large.json()["prompts"][0]
    assert missing.status_code == 400 and "not a file" in missing.json()["prompts"][0]


@pytest.mark.parametrize(
    ("field", "value"),
    [("epochs", 1_000_000_000), ("epochs", 0), ("epochs", 101), ("seed", 2**63), ("seed", -1)],
)
def test_numbers_out_of_range_are_refused(api, tiny_model_dir, root, field, value):
    response = _post(api, tiny_model_dir, root, **{field: value})

    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not TrainingRun.objects.exists()


def test_an_unknown_field_is_refused_naming_it(api, tiny_model_dir, root):
    response = _post(api, tiny_model_dir, root, epocs=3, max_prompts=10)

    assert response.status_code == 400
    assert set(response.json()) == {"epocs", "max_prompts"}
    assert "Unknown field 'epocs'" in response.json()["epocs"][0]
    assert not TrainingRun.objects.exists()
