"""Workloads: the key every gateway request carries (given or classified) that auto-pairing groups by."""
