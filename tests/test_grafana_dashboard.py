"""docs/grafana/ace-speculation.json is built on the metric names /metrics exposes (a rename breaks this test)."""

from __future__ import annotations

import json
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ace import processes

DASHBOARD = processes.REPO_ROOT / "docs" / "grafana" / "ace-speculation.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exprs(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in _exprs(value)]
    if isinstance(node, list):
        return [e for value in node for e in _exprs(value)]
    return []


@pytest.mark.django_db
def test_every_metric_the_dashboard_queries_is_exposed(client, redis_server):
    exposed = set()
    for family in text_string_to_metric_families(client.get("/metrics").content.decode()):
        exposed |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for expr in _exprs(dashboard) for name in re.findall(r"\bace_[a-z_]+", expr)}
    assert len(queried) >= 10
    assert queried <= exposed, sorted(queried - exposed)
    templated = dashboard["templating"]["list"][1]["definition"]
    assert "ace_requests_total" in templated
