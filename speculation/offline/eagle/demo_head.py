"""Where the demo target's trained EAGLE head lives, and its proposer when it exists.

Both benchmarks (`python -m speculation.bench` and `python -m speculation.bench.eagle`) use it; neither
imports the other.
"""

from __future__ import annotations

from pathlib import Path

from speculation.engine.eagle import EagleProposer
from speculation.offline.demo.build import ace_home


def default_head_dir(pair) -> Path:
    return ace_home() / "models" / f"{pair.root.name}-eagle"


def eagle_proposer_for(pair, target_model, head_dir: Path | None = None) -> EagleProposer | None:
    """The demo target's EAGLE proposer when a head is there (None otherwise)."""
    head_dir = head_dir or default_head_dir(pair)
    if not (head_dir / "config.json").is_file():
        return None
    return EagleProposer.from_dir(head_dir, target_model, target_dir=pair.target_dir)
