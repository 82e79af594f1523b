"""The fuzz run (`python manage.py fuzz_api`): ACE's REST API from its own OpenAPI schema and the gateway's
bodies, against ACE under uvicorn with a real Redis and a real model server; counts 5xx answers and tracebacks
in ACE's log. The aim, and what docs/SECURITY.md records: 0 and 0."""

from __future__ import annotations

import re
from typing import Any

from ace.fuzz.gateway import Upstream, fuzz_gateway
from ace.fuzz.rest import fuzz_classes, fuzz_rest
from ace.fuzz.stack import FuzzStack

TRACEBACK = re.compile(r"^Traceback \(most recent call last\):", re.MULTILINE)
QUICK_EXAMPLES, FULL_EXAMPLES = 5, 40
PARTS = ("gateway", "classes", "rest")  # classes: the input classes of ace.fuzz.classes over every REST operation


def run(stack: FuzzStack, *, quick: bool, rest: bool = True, gateway: bool = True) -> dict[str, Any]:
    """Fuzz a started stack: the gateway first (the REST fuzz may delete its endpoints), then the input classes
    over REST, then REST from its schema."""
    result: dict[str, Any] = {"quick": quick, "endpoints": stack.endpoints}
    if gateway:
        models = {mode: info["name"] for mode, info in stack.endpoints.items()}
        upstream = Upstream(stack.upstream, next(iter(stack.endpoints.values()))["served_model"])
        report = fuzz_gateway(ace_url=stack.ace_url, token=stack.token, models=models, quick=quick, upstream=upstream)
        result["gateway"] = report.as_dict()
    if rest:
        path_id = min(info["id"] for info in stack.endpoints.values())
        result["classes"] = fuzz_classes(
            ace_url=stack.ace_url, token=stack.token, path_id=path_id, quick=quick
        ).as_dict()
        examples = QUICK_EXAMPLES if quick else FULL_EXAMPLES
        result["rest"] = fuzz_rest(ace_url=stack.ace_url, token=stack.token, max_examples=examples).as_dict()
    log = stack.log_text()
    tracebacks = TRACEBACK.findall(log)
    result["log_tracebacks"] = len(tracebacks)
    result["log_excerpts"] = [m.group(0) for m in re.finditer(r"^.*(?:ERROR|Traceback).*$", log, re.MULTILINE)][:20]
    result["server_errors"] = sum(result[part]["server_errors"] for part in PARTS if part in result)
    result["ok"] = result["server_errors"] == 0 and result["log_tracebacks"] == 0
    return result


__all__ = ["PARTS", "FuzzStack", "run"]
