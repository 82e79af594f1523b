"""One request through the gateway: what the client sent, where it goes, and its request id."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from speculation.gateway.routes import Route

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class Call:
    route: Route
    kind: str  # "chat" | "completion"
    body: dict[str, Any]
    raw: bytes
    request_id: str
    workload: str = ""  # the workload key its stage records carry (speculation.workloads.keys); "" in off mode
    load_bucket: str = ""  # the load bucket the goodput guard counted it in (speculation.gateway.goodput)
    traffic: str = ""  # "greedy" | "sampled", for the goodput guard's samples
    guard_reason: str = ""  # why the goodput guard let it speculate (its record's reason); "" with the guard off
    started: float = field(default_factory=time.perf_counter)

    @property
    def url(self) -> str:
        return self.route.base_url + PATHS[self.kind]

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def upstream_model(self) -> str:
        return self.route.served_model or str(self.body.get("model"))

    def upstream_bytes(self, **overrides: Any) -> bytes:
        """The body to send upstream: the client's own bytes when nothing needs changing (the off path)."""
        if not overrides and self.body.get("model") == self.upstream_model:
            return self.raw
        body = dict(self.body)
        body["model"] = self.upstream_model
        body.update(overrides)
        return json.dumps(body).encode()

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0
