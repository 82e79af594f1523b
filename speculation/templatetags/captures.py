"""Template tag of the captured-traffic include: the endpoint's capture setting and sizes, for its team's admins."""

from __future__ import annotations

from django import template
from django.core.exceptions import PermissionDenied
from django.http import Http404

from fleet.permissions import check_captures
from speculation.selectors.captures import summary
from speculation.services.captures import get_setting

register = template.Library()


@register.simple_tag
def captures_for(user, endpoint) -> dict | None:
    """{"setting", "summary"} when the user may see the endpoint's captured traffic, else None (nothing shown)."""
    try:
        check_captures(user, endpoint)
    except (Http404, PermissionDenied):
        return None
    return {"setting": get_setting(endpoint=endpoint), "summary": summary(endpoint_id=endpoint.pk)}
