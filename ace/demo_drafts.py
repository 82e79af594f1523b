"""The run command's candidates for the demo target, so that auto-pairing has a choice that matters on the demo.

- `demo-draft`: the demo pair's main draft (speculation.offline.demo: on demo-v3 distilled on code and its
  comments, from demo-v6 on on English);
- `demo-<label>` for each other draft of the demo version (`DemoPair.extra_drafts`, the same tokenizer:
  `demo-draft-prose` on demo-v3, distilled on English only; `demo-draft-code` from demo-v6 on, on code only);
- `demo-eagle`: the EAGLE head for the demo target in `$ACE_HOME/models/<version>-eagle`: for the default version
  the shipped multi-layer head (`models/`, recipe `eagle3-prose` of speculation.offline.eagle.demo_head), ready
  at the first start. A version without a shipped head gets one trained in the background with `manage.py
  train_eagle` (a training run the dashboard shows, registered as `demo-eagle` when done), niced.

A draft registered by an earlier run that points elsewhere (an older demo version) follows the current one.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

DEMO_DRAFT = "demo-draft"
DEMO_EAGLE = "demo-eagle"
# The background recipe for a demo version without a shipped head: short (about 8 min on a 2-core CPU).
EAGLE_RECIPE = (
    *("--prompts", "spec_bench,stdlib", "--max-prompts", "96", "--epochs", "4"),
    *("--new-tokens", "48", "--text-windows", "256", "--seed", "0"),
)


def draft_name(label: str) -> str:
    """The registered name of a demo draft labelled `label` in DemoPair.drafts ("draft" is the main one)."""
    return DEMO_DRAFT if label == "draft" else f"demo-{label}"


def ensure_draft(*, name: str, kind: str, path: str, target_name: str, owner=None):
    """The draft `name` at `path`: registered, or moved there (facts re-read) when it pointed elsewhere.

    `owner`: the run command's admin, like the demo endpoint's (a draft of an earlier run without one gets it).
    """
    from speculation.models import DraftModel
    from speculation.services.drafts import inspect_draft_dir, register_draft

    found = DraftModel.objects.filter(name=name).first()
    if found is None:
        return register_draft(name=name, kind=kind, path=path, node_class="cpu", target_name=target_name, owner=owner)
    if found.owner_id is None and owner is not None:
        DraftModel.objects.filter(pk=found.pk).update(owner=owner)
        found.owner = owner
    facts = inspect_draft_dir(path, kind=kind)
    if found.path == facts["path"] and found.kind == kind:
        return found
    for field, value in facts.items():
        setattr(found, field, value)
    found.kind = kind
    found.full_clean()
    found.save()
    return found


def register_demo_drafts(*, drafts: dict[str, str], eagle_dir: str, target_name: str, owner=None) -> list:
    """Every demo draft ({label: directory}, the main one first) and the EAGLE head when it is built, `owner`'s."""
    from django.core.exceptions import ValidationError

    from speculation.models import DraftKind

    found = [
        ensure_draft(
            name=draft_name(label), kind=DraftKind.DRAFT_MODEL, path=path, target_name=target_name, owner=owner
        )
        for label, path in drafts.items()
    ]
    if eagle_ready(eagle_dir):
        try:
            found.append(
                ensure_draft(
                    name=DEMO_EAGLE, kind=DraftKind.EAGLE_HEAD, path=eagle_dir, target_name=target_name, owner=owner
                )
            )
        except ValidationError as exc:  # the endpoint and its drafts stand without the head
            logger.warning("the demo EAGLE head in %s not registered: %s", eagle_dir, "; ".join(exc.messages))
    return found


def eagle_ready(eagle_dir: str) -> bool:
    return (Path(eagle_dir) / "config.json").is_file()


def eagle_training_argv(*, target_dir: str, eagle_dir: str, target_name: str) -> list[str]:
    """`manage.py train_eagle` for the demo head, niced (the web, the worker and vLLM come first)."""
    return [
        *("nice", "-n", "10", sys.executable, "manage.py", "train_eagle"),
        *("--target", target_dir, "--out", eagle_dir, "--name", DEMO_EAGLE, "--target-name", target_name),
        *EAGLE_RECIPE,
    ]
