"""``python -m speculation.offline.demo``: build the demo pair if needed and print where it is."""

from __future__ import annotations

import json
import logging

from speculation.offline.demo import ensure_demo_pair


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pair = ensure_demo_pair()
    print(f"root:   {pair.root}")
    print(f"target: {pair.target_dir}")
    print(f"draft:  {pair.draft_dir}")
    for label, path in pair.extra_drafts.items():
        print(f"{label}: {path}")
    print(json.dumps(pair.build_info, indent=2))


if __name__ == "__main__":
    main()
