"""The jobs the gateway queues for a GPU worker: typed on both ends, plain JSON on the Celery/Redis wire.

`ProdJob` is one prod request the worker serves through its speculative path; `ShadowJob` is one served request
the worker replays to measure what speculation would have gained. The wire form has no version: `from_dict`
refuses a job with a field it does not know or without one it needs (a gateway and a worker of different code
must not half-understand each other), naming the field. Standard library only: the web process imports it.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, TypeVar

_Job = TypeVar("_Job", "ProdJob", "ShadowJob")


class JobFormatError(ValueError):
    """A queued job this code cannot read (an unknown or a missing field)."""


def _from_dict(cls: type[_Job], data: Any) -> _Job:
    if not isinstance(data, dict):
        raise JobFormatError(f"a {cls.__name__} is a JSON object, got {type(data).__name__}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise JobFormatError(f"a {cls.__name__} has no field {unknown[0]!r} (fields: {', '.join(sorted(known))})")
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    missing = [name for name in required if name not in data]
    if missing:
        raise JobFormatError(f"a {cls.__name__} needs {missing[0]!r}")
    return cls(**data)


@dataclass(frozen=True)
class ProdJob:
    """One prod request for the worker: the prompt as token ids, how far to generate, and how."""

    request_id: str
    endpoint_id: int
    prompt_ids: list[int]
    max_tokens: int  # new tokens, as the server reads the request's length fields
    k: int  # the policy's lookahead K
    path: str  # the verification path (speculation.models.VerificationPath): local or remote
    node_class: str  # whose GPU queue, and whose admission slot
    # what the worker's GenerationConfig takes (speculation.gateway.sampling.RequestSampling.job); None: greedy
    sampling: dict[str, Any] | None = None
    stop: dict[str, Any] = field(default_factory=dict)  # the request's stop fields (openai_fields.STOP) it set
    workload: str = ""  # the request's workload key: with `draft: auto` its best candidate and K run

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ProdJob:
        return _from_dict(cls, data)

    @classmethod
    def of(cls, job: ProdJob | dict[str, Any]) -> ProdJob:
        """The job itself, or read from its wire form."""
        return job if isinstance(job, ProdJob) else cls.from_dict(job)


@dataclass(frozen=True)
class ShadowJob:
    """One request the endpoint served plain, with its output as token ids, for the worker to replay."""

    endpoint_id: int
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    max_tokens: int | None
    temperature: float  # 0 when the server decoded greedily (speculation.openai_fields.is_greedy)
    latency_ms: float  # the plain request end to end: the baseline the replay is measured against
    top_p: float = 1.0
    top_k: int = 0
    workload: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> ShadowJob:
        return _from_dict(cls, data)
