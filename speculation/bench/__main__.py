"""``python -m speculation.bench``: the engine's benchmark (speculation/bench/engine.py), as the README says."""

from speculation.bench.engine import main

raise SystemExit(main())
