"""The endpoint page's views (`?view=`): what each one reads, and nothing more.

One long page grew to about 10,000 pixels (capabilities, probes, managed server, settings, five charts, two tables,
records); it is split into short views a tab bar links: the overview (the default: the policy in a few lines, the
key figures and the charts), settings, auto-pairing (with shadow's per-K projection), server and probes, records.
Each view reads only what it shows, so a view stays as cheap as its own tables.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.http import HttpRequest, QueryDict
from django.urls import reverse
from django.utils import timezone

from fleet import selectors as fleet_selectors
from fleet.models import Endpoint
from speculation.models import DraftModel, SpeculationPolicy
from speculation.selectors import autopairing, options, rollups
from speculation.selectors import costs as cost_selectors
from speculation.selectors.drafts import visible_drafts
from speculation.services import path_choice
from speculation.services import policies as policy_service
from speculation.web.forms import PolicyForm, RecordFilterForm, tree_text
from speculation.workloads import keys as workload_keys

RECORDS_PER_PAGE = 25
RECENT_CHANGES = 10
CHART_METRICS = ("acceptance_rate", "multiplier", "tok_s")
VIEWS = {  # name: tab label, in the tab bar's order; the first is the default
    "overview": "Overview",
    "settings": "Settings",
    "autopairing": "Auto-pairing",
    "server": "Server & probes",
    "records": "Records",
}
DEFAULT_VIEW = "overview"


class UnknownView(ValueError):
    """`?view=` names no view of the page."""


def view_of(request: HttpRequest) -> str:
    """The view asked for (absent: the overview); UnknownView names the choices."""
    name = request.GET.get("view") or DEFAULT_VIEW
    if name not in VIEWS:
        raise UnknownView(f"unknown view {name[:40]!r}: one of {', '.join(VIEWS)}")
    return name


def time_range(request: HttpRequest) -> rollups.TimeRange:
    try:
        return rollups.get_range(request.GET.get("range"))
    except ValueError:
        return rollups.get_range(None)


def policy_of(endpoint: Endpoint) -> SpeculationPolicy:
    """The stored policy, or the default (off) one unsaved: a page view never creates a policy."""
    try:
        return endpoint.policy
    except SpeculationPolicy.DoesNotExist:
        return SpeculationPolicy(endpoint=endpoint)


def drafts_offered(request: HttpRequest, policy: SpeculationPolicy) -> list[DraftModel]:
    """The drafts the user may choose on the settings form: those it can see, and the policy's own."""
    current = DraftModel.objects.filter(pk=policy.draft_id)
    return list((visible_drafts(request.user) | current).order_by("name"))


def _workload(request: HttpRequest) -> str | None:
    """The page's workload filter (?workload=KEY); absent or not a valid key: every workload."""
    value = request.GET.get("workload")
    if not value:
        return None
    try:
        return workload_keys.checked_key(value, param="workload")
    except workload_keys.BadWorkload:
        return None


def _id_param(request: HttpRequest, name: str) -> int | None:
    """A record id the records table pages from; anything else: none (the newest page)."""
    value = request.GET.get(name, "")
    return int(value) if value.isdigit() and len(value) < 19 else None


def _tabs(endpoint: Endpoint, *, range_name: str, workload: str | None) -> list[dict[str, str]]:
    """Plain links, keeping the range and workload the user chose."""
    base = reverse("speculation:endpoint", args=[endpoint.pk])
    tabs = []
    for name, label in VIEWS.items():
        query = QueryDict(mutable=True)
        if name != DEFAULT_VIEW:
            query["view"] = name
        query["range"] = range_name
        if workload:
            query["workload"] = workload
        tabs.append({"name": name, "label": label, "url": f"{base}?{query.urlencode()}"})
    return tabs


@path_choice.remembered()
def context(request: HttpRequest, endpoint: Endpoint, *, view: str, form: PolicyForm | None = None) -> dict:
    """The page's context for one view: what every view shows (title, tabs, mode) and that view's own."""
    chosen = time_range(request)
    workload = _workload(request)
    policy = policy_of(endpoint)
    common = {
        "endpoint": endpoint,
        "policy": policy,
        "view": view,
        "view_template": f"speculation/endpoint/{view}.html",
        "tabs": _tabs(endpoint, range_name=chosen.name, workload=workload),
        "range": chosen,
        "ranges": list(rollups.RANGES),
        "workload": workload or "",
    }
    own = _BUILDERS[view](request, endpoint, policy, chosen=chosen, workload=workload, form=form)
    return common | own


def _overview(request: HttpRequest, endpoint: Endpoint, policy: SpeculationPolicy, **kw: Any) -> dict:
    chosen, workload = kw["chosen"], kw["workload"]
    now = timezone.now()
    charts, totals = rollups.endpoint_page_data(  # the charts and the figures beside them, one read
        endpoint_id=endpoint.pk, metrics=CHART_METRICS, range_name=chosen.name, now=now, workload=workload
    )
    return {
        "path": options.effective_path(policy=policy, endpoint=endpoint),
        "path_warning": policy_service.path_warning(policy=policy, endpoint=endpoint),
        "figures": rollups.range_summary(totals),
        "workloads": rollups.workloads_seen(endpoint_id=endpoint.pk, since=chosen.since(now), totals=totals),
        "charts": charts,
        "has_chart_data": any(s["y"] for m in CHART_METRICS for s in charts[m]["series"]),
        "timeseries_url": reverse("dashboard-api:endpoint-timeseries", args=[endpoint.pk]),
    }


def _policy_initial(policy: SpeculationPolicy) -> dict:
    return {
        "mode": policy.mode,
        "mechanism": policy.mechanism,
        "draft": policy.draft.name if policy.draft_id else "",
        "k": policy.k,
        "dynamic_k": policy.dynamic_k,
        "eagle_tree": tree_text(policy.eagle_tree),
        "auto_pairing": policy.auto_pairing,
        "shadow_sample_rate": policy.shadow_sample_rate,
        "path": policy.path,
        "target_path": policy.target_path,
    }


def _settings(request: HttpRequest, endpoint: Endpoint, policy: SpeculationPolicy, **kw: Any) -> dict:
    drafts = drafts_offered(request, policy)
    form = kw["form"] or PolicyForm(initial=_policy_initial(policy), draft_names=[d.name for d in drafts])
    return {
        "form": form,
        "mode_options": options.mode_options(policy=policy, endpoint=endpoint),
        "draft_options": options.draft_options(policy=policy, endpoint=endpoint, drafts=drafts),
        "path_options": options.path_options(policy=policy, endpoint=endpoint),
        "changes": list(policy.changes.select_related("changed_by")[:RECENT_CHANGES]) if policy.pk else [],
    }


def _autopairing(request: HttpRequest, endpoint: Endpoint, policy: SpeculationPolicy, **kw: Any) -> dict:
    """Shadow's projection beside prod's measurement per K, the costs the worker measured, auto-pairing's table."""
    since: datetime = kw["chosen"].since(timezone.now())
    totals = rollups.endpoint_totals(endpoint_id=endpoint.pk, since=since)
    alpha = rollups.measured_acceptance(endpoint_id=endpoint.pk, since=since, totals=totals).get("alpha")
    return {
        "pairing": autopairing.pairing_table(endpoint_id=endpoint.pk),
        "calibration": cost_selectors.measured_costs(endpoint=endpoint),
        "projection_rows": cost_selectors.projection_vs_prod(
            endpoint=endpoint, since=since, alpha=alpha, totals=totals
        ),
    }


def _server(request: HttpRequest, endpoint: Endpoint, policy: SpeculationPolicy, **kw: Any) -> dict:
    """What fleet/endpoint_detail.html shows (capabilities, probe history with live progress, managed server)."""
    return fleet_selectors.endpoint_detail(endpoint=endpoint)


def _records(request: HttpRequest, endpoint: Endpoint, policy: SpeculationPolicy, **kw: Any) -> dict:
    filters = RecordFilterForm(request.GET or None)
    clean = filters.cleaned_data if filters.is_valid() else {}
    record_range = rollups.get_range(clean.get("range") or kw["chosen"].name)
    records = rollups.stage_records(
        endpoint_id=endpoint.pk,
        action=clean.get("action") or None,
        mode=clean.get("mode") or None,
        since=record_range.since(timezone.now()),
        workload=kw["workload"],
    )
    page = rollups.record_page(
        records, before=_id_param(request, "before"), after=_id_param(request, "after"), size=RECORDS_PER_PAGE
    )
    query = request.GET.copy()
    for cursor in ("before", "after", "page"):
        query.pop(cursor, None)
    query["view"] = "records"
    return {"filters": filters, "page": page, "page_query": query.urlencode()}


_BUILDERS: dict[str, Callable[..., dict]] = {
    "overview": _overview,
    "settings": _settings,
    "autopairing": _autopairing,
    "server": _server,
    "records": _records,
}
