"""The demo target/draft pair: a small Llama and its distilled draft, built locally from stdlib sources."""

from speculation.offline.demo.build import DemoPair, ensure_demo_pair

__all__ = ["DemoPair", "ensure_demo_pair"]
