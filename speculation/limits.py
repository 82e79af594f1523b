"""Limits of the speculation stage, torch-free so the web process, the worker and the REST layer share them.

Standard library only: the engine imports it too (tests/speculation/engine/test_engine_imports.py keeps the
engine's imports to torch, the standard library and such stdlib-only modules of the stage).
"""

from __future__ import annotations

K_MIN, K_MAX = 1, 16  # lookahead K: draft tokens proposed per verification step
