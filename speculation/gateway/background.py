"""The gateway's fire-and-forget work: ace.background (one task set for the process, which tests drain)."""

from ace.background import _pending, spawn

__all__ = ["_pending", "spawn"]
