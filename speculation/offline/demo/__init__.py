"""The demo target/draft pair: a small Llama and its distilled drafts, built locally from stdlib sources
(``speculation.offline.demo.build``'s docstring describes ``DemoPair``)."""

from speculation.offline.demo.build import DEMO_VERSION, DemoPair, ensure_demo_pair

__all__ = ["DEMO_VERSION", "DemoPair", "ensure_demo_pair"]
