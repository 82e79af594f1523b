"""The identity check against a real server: the demo target reproduces the vLLM (CPU, float32) serving it, well
inside the tolerance; the demo draft, with the same tokenizer, does not (the figures behind the tolerance)."""

from __future__ import annotations

import logging

import pytest

from fleet.adapters.base import REFERENCE_TOKENS
from speculation.engine.identity import LOGPROB_TOLERANCE_NATS, Reference, check_directory
from speculation.services import target_identity
from tests.support.stack import register_probed_endpoint

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.django_db]
logger = logging.getLogger(__name__)


def test_the_demo_target_reproduces_the_vllm_serving_it_and_the_demo_draft_does_not(vllm_server, demo_pair):
    # given: the demo endpoint probed on the real vLLM serving the demo target
    endpoint = register_probed_endpoint(name="demo", base_url=vllm_server.base_url)
    reference = Reference.from_json(endpoint.capabilities["canary_reference"])
    assert len(reference.continuation) == REFERENCE_TOKENS and reference.top is not None
    # when: both demo folders are compared with what the server answered
    target = check_directory(demo_pair.target_dir, reference)
    draft = check_directory(demo_pair.draft_dir, reference)
    logger.info("demo target vs vLLM: %s; demo draft vs vLLM: %s", target, draft)
    # then: the served files agree within a tenth of the tolerance; the draft is refused
    assert target.mismatch is None and target.max_logprob_diff < LOGPROB_TOLERANCE_NATS / 10, target
    assert draft.mismatch is not None, draft
    # and a policy save asks the same through the service
    assert target_identity.check(endpoint=endpoint, target_path=str(demo_pair.target_dir)).problem == ""
    problem = target_identity.check(endpoint=endpoint, target_path=str(demo_pair.draft_dir)).problem
    assert problem.startswith("target_path does not reproduce the endpoint's model"), problem
