"""Fuzz the REST API from its own OpenAPI schema (/api/schema/) with schemathesis: for every operation, cases
that follow the schema (positive) and cases that break it (negative), sent to ACE with an admin token.
Every answer is tallied; a 5xx is kept as a finding with the request that caused it."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from schemathesis import GenerationMode

from ace.fuzz.classes import rest_cases


@dataclass
class RestReport:
    operations: int = 0
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    server_errors: int = 0
    transport_errors: int = 0
    not_generated: list[str] = field(default_factory=list)  # operations schemathesis could not generate for
    findings: list[dict[str, Any]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "operations": self.operations,
            "requests": self.requests,
            "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0]))},
            "server_errors": self.server_errors,
            "transport_errors": self.transport_errors,
            "not_generated": self.not_generated,
            "findings": self.findings[:50],
        }


def load_schema(ace_url: str, token: str) -> dict[str, Any]:
    response = httpx.get(
        f"{ace_url}/api/schema/", params={"format": "json"}, headers={"Authorization": f"Token {token}"}, timeout=60
    )
    response.raise_for_status()
    return response.json()


def fuzz_rest(*, ace_url: str, token: str, max_examples: int) -> RestReport:
    """Deterministic (hypothesis derandomized): the same schema gives the same cases."""
    schema = schemathesis.openapi.from_dict(load_schema(ace_url, token))
    report = RestReport()
    session = requests.Session()
    headers = {"Authorization": f"Token {token}"}
    for result in schema.get_all_operations():
        try:
            operation = result.ok()
        except Exception as exc:  # an operation schemathesis cannot read: say so, keep going
            report.not_generated.append(f"(unreadable operation): {exc}"[:200])
            continue
        report.operations += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run_operation(operation, mode, report, session, ace_url, headers, max_examples)
    return report


def _run_operation(operation, mode, report, session, ace_url, headers, max_examples) -> None:
    label = f"{operation.method.upper()} {operation.path} ({mode.value})"

    @hypothesis_settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        report.requests += 1
        try:
            response = case.call(base_url=ace_url, session=session, headers=headers, timeout=60)
        except requests.RequestException as exc:
            report.transport_errors += 1
            report.statuses[type(exc).__name__] += 1
            return
        report.statuses[response.status_code] += 1
        if response.status_code >= 500:
            report.server_errors += 1
            if len(report.findings) < 200:
                request = response.request
                body = request.body[:300] if isinstance(request.body, bytes | str) else request.body
                report.findings.append(
                    {"operation": label, "status": response.status_code, "url": request.url, "body": str(body)}
                )

    try:
        run()
    except Exception as exc:  # Unsatisfiable and friends: no case could be generated in this mode
        report.not_generated.append(f"{label}: {type(exc).__name__}: {str(exc)[:150]}")


def fuzz_classes(*, ace_url: str, token: str, path_id: int, quick: bool) -> RestReport:
    """The input classes of ace.fuzz.classes over every operation of the schema, each request once."""
    schema = load_schema(ace_url, token)
    report = RestReport(operations=sum(len(ops) for ops in schema.get("paths", {}).values()))
    headers = {"Authorization": f"Token {token}", "Content-Type": "application/json"}
    with httpx.Client(base_url=ace_url, headers=headers, timeout=60) as http:
        for case in rest_cases(schema, path_id=path_id, quick=quick):
            report.requests += 1
            try:
                response = http.request(case.method.upper(), case.path, content=case.body)
            except httpx.HTTPError as exc:
                report.transport_errors += 1
                report.statuses[type(exc).__name__] += 1
                continue
            report.statuses[response.status_code] += 1
            if response.status_code >= 500:
                report.server_errors += 1
                if len(report.findings) < 200:
                    report.findings.append({"operation": case.label, "status": response.status_code})
    return report
