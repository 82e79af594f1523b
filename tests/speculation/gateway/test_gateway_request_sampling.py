"""Which sampling prod serves on which path (speculation.gateway.sampling), without a server."""

from __future__ import annotations

import pytest

from speculation.gateway.sampling import RequestSampling, parse, path_reason

CAPS = {"max_logprobs": 20}


def test_vllms_defaults_and_greedy_threshold():
    assert parse({"temperature": 0}) == RequestSampling(temperature=0.0, top_k=0, top_p=1.0, seed=None)
    assert parse({"temperature": 1e-6}).greedy  # vLLM samples greedily below 1e-5
    assert parse({"temperature": 0.7, "top_k": -1, "top_p": 0.9, "seed": 3}) == RequestSampling(0.7, 0, 0.9, 3)


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"temperature": "hot"}, "temperature 'hot' is not a number"),
        ({"temperature": [0]}, "is not a number"),
        ({"temperature": 0.7, "top_p": 0}, "top_p 0.0 outside (0, 1]"),
        ({"temperature": 0.7, "top_k": -2}, "top_k -2"),
        ({"temperature": 0.7, "min_p": 0.1}, "min_p"),
        ({"temperature": 0.7, "seed": "x"}, "seed 'x'"),
    ],
)
def test_what_cannot_be_served_exactly_says_why(body, reason):
    found = parse(body)
    assert isinstance(found, str) and reason in found


def test_a_seed_is_kept_and_a_missing_one_is_drawn_per_request():
    assert parse({"temperature": 0.7, "seed": 5}).job()["seed"] == 5
    unseeded = parse({"temperature": 0.7})
    assert len({unseeded.job()["seed"] for _ in range(5)}) > 1
    # the worker may choose K for a request without a seed (nothing to reproduce), not for one with a seed
    assert unseeded.job()["seeded"] is False and "seeded" not in parse({"temperature": 0.7, "seed": 5}).job()
    assert parse({"temperature": 0}).job() == {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0}


def test_the_local_path_serves_any_sampling_and_the_remote_path_only_a_known_top_k():
    sampled = parse({"temperature": 0.7, "top_p": 0.9})
    assert path_reason(sampled, path="local", capabilities=CAPS) == ""
    assert "temperature 0.7 with no top_k on the remote path" in path_reason(sampled, path="remote", capabilities=CAPS)
    assert path_reason(parse({"temperature": 0.7, "top_k": 5}), path="remote", capabilities=CAPS) == ""
    assert "0 < top_k < 20" in path_reason(parse({"temperature": 0.7, "top_k": 20}), path="remote", capabilities=CAPS)
    assert "top-0" in path_reason(parse({"temperature": 0.7, "top_k": 5}), path="remote", capabilities={})
    assert path_reason(parse({"temperature": 0}), path="remote", capabilities={}) == ""
