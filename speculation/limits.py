"""Limits of the speculation stage, torch-free so the web process, the worker and the REST layer share them.

The engine (speculation.engine.lookahead) keeps the same K range as its own constants, because it imports
nothing outside torch and the standard library; tests/speculation/test_limits.py checks that the two agree.
"""

from __future__ import annotations

K_MIN, K_MAX = 1, 16  # lookahead K: draft tokens proposed per verification step
