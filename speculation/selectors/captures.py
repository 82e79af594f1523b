"""Reads of an endpoint's captured traffic: sizes per workload (for its team's admins), and the decrypted
sequences a training run trains on (for the worker only: nothing here is shown on a page or over REST)."""

from __future__ import annotations

from django.db.models import Count, Max, Min, Sum

from speculation.models import CapturedRequest
from speculation.offline.eagle.prompts import CapturedSequence
from speculation.services.captures import open_capture


def summary(*, endpoint_id: int) -> dict:
    """Per workload and in total: captured requests, prompt and output tokens, stored bytes, oldest and newest."""
    rows = (
        CapturedRequest.objects.filter(endpoint_id=endpoint_id)
        .values("workload")
        .annotate(
            requests=Count("id"),
            prompt_tokens=Sum("prompt_tokens"),
            output_tokens=Sum("output_tokens"),
            bytes=Sum("size_bytes"),
            oldest=Min("created_at"),
            newest=Max("created_at"),
        )
        .order_by("workload")
    )
    workloads = {row.pop("workload"): row for row in rows}
    total = {name: sum(w[name] for w in workloads.values()) for name in ("requests", "prompt_tokens", "output_tokens",
                                                                         "bytes")}  # fmt: skip
    return {"workloads": workloads, "total": total}


def sequences(*, endpoint_id: int, workload: str | None = None, limit: int = 0) -> list[CapturedSequence]:
    """The endpoint's captures (one workload's, or all), oldest first, decrypted; `limit` > 0 keeps the newest."""
    rows = CapturedRequest.objects.filter(endpoint_id=endpoint_id)
    if workload is not None:
        rows = rows.filter(workload=workload)
    rows = rows.order_by("-created_at", "-id")
    if limit:
        rows = rows[:limit]
    out = []
    for row in reversed(list(rows)):
        prompt_ids, output_ids = open_capture(row)
        out.append(
            CapturedSequence(
                category=row.workload,
                prompt_ids=prompt_ids,
                output_ids=output_ids,
                capture_id=row.pk,
                greedy=row.greedy,
            )
        )
    return out
