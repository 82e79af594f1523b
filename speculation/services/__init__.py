"""Speculation services: policy, draft registry and stage records (the writes, with their validation)."""
