from django import template

from fleet.managed import selectors

register = template.Library()


@register.inclusion_tag("fleet/managed/_panel.html")
def managed_panel(endpoint):
    """The managed server's panel on an endpoint page (nothing for an endpoint registered by URL)."""
    managed = selectors.managed_for(endpoint)
    return {"state": selectors.managed_state(managed) if managed is not None else None, "endpoint": endpoint}
