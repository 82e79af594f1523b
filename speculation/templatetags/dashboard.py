"""Template filters of the dashboard pages."""

from __future__ import annotations

from django import template

register = template.Library()

_SI = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


@register.filter
def count_si(value: int | float | None) -> str:
    """A count in decimal units, as model sizes are quoted: 68000000 -> "68.0M", 1240000000 -> "1.24B"."""
    if value is None:
        return "—"
    for scale, suffix in _SI:
        if abs(value) >= scale:
            scaled = value / scale
            return f"{scaled:.3g}{suffix}" if scaled < 100 else f"{scaled:.0f}{suffix}"
    return str(int(value))
