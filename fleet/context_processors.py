"""Template context: the signed-in user's role, so pages offer only what the user may do (fleet.permissions).

Operators operate every endpoint they can see and admins every endpoint, so `can_write` is all a page needs to
hide a control; the views check again on every write.
"""

from __future__ import annotations

from django.http import HttpRequest

from fleet.permissions import can_write, role_of


def role(request: HttpRequest) -> dict[str, object]:
    user = getattr(request, "user", None)
    return {"ace_role": role_of(user), "can_write": can_write(user)}
