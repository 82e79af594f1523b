"""A head trained on captured traffic, proved on the captured requests it was not trained on.

When a run on an endpoint's captured traffic has registered its head, each held-out capture (the oldest of each
workload, as the run split them) that was served greedily is replayed through every compatible candidate of its
endpoint, the new head among them (speculation.worker.candidates.measure_candidates, unbudgeted: an operator's
act, not live traffic). The auto-pairing table then shows the head's projected multiplier per workload, with its
interval, beside the current pairing's at once, live shadow traffic adds to it, and a `draft: auto` policy may
switch to it (its change history names the run and its data: speculation.services.autopairing.trained_on).
A sampled capture is not replayed: its sampling parameters are not kept, and a greedy replay of a sampled output
would understate every candidate alike but not exactly.
"""

from __future__ import annotations

import logging

from fleet.models import Endpoint
from speculation.models import CapturedRequest
from speculation.offline.eagle.prompts import CapturedSequence
from speculation.services.policies import get_policy

logger = logging.getLogger(__name__)

REQUEST_PREFIX = "capture-"  # a replayed capture's request id: this prefix and the capture's id


def replay_held_out(held_out: list[CapturedSequence]) -> int:
    """Replay the greedy ones of these held-out captures on their endpoints' candidates; returns how many were."""
    from speculation.worker.candidates import maybe_auto_apply, measure_candidates  # torch: the worker's

    greedy = [s for s in held_out if s.greedy]
    endpoints = dict(
        CapturedRequest.objects.filter(pk__in=[s.capture_id for s in greedy]).values_list("pk", "endpoint")
    )
    policies = {  # an endpoint that never had a policy has the default (off) one: its candidates are measured alike
        endpoint.pk: get_policy(endpoint=endpoint) for endpoint in Endpoint.objects.filter(pk__in=endpoints.values())
    }
    replayed = 0
    for sequence in greedy:
        policy = policies.get(endpoints.get(sequence.capture_id))
        if policy is None:  # its capture or endpoint was deleted meanwhile
            continue
        measure_candidates(
            endpoint=policy.endpoint,
            policy=policy,
            request_id=f"{REQUEST_PREFIX}{sequence.capture_id}",
            workload=sequence.category,
            prompt_ids=sequence.prompt_ids,
            output_ids=sequence.output_ids,
            max_tokens=None,
            budgeted=False,
        )
        replayed += 1
    for policy in policies.values():
        maybe_auto_apply(policy.endpoint, policy)
    logger.info("replayed %d of %d held-out captures on their endpoints' candidates", replayed, len(held_out))
    return replayed
