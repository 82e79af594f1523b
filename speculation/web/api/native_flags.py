"""GET /api/v1/endpoints/{id}/native-flags/?draft=<id or name>&k=<K>: the server launch flags for a draft."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from ace.query_params import id_param, is_ascii_digits
from fleet.permissions import endpoint_for
from speculation.models import DraftModel
from speculation.selectors import native_flags
from speculation.selectors.drafts import visible_drafts

_RESPONSE = inline_serializer(
    "NativeFlags",
    fields={
        "server_kind": serializers.CharField(),
        "draft_kind": serializers.CharField(),
        "draft": serializers.CharField(allow_null=True),
        "k": serializers.IntegerField(),
        "args": serializers.ListField(child=serializers.CharField()),
        "command_line": serializers.CharField(),
        "speculative_config": serializers.DictField(allow_null=True),
        "notes": serializers.ListField(child=serializers.CharField()),
    },
)


def _draft_from(value: str | None, user) -> DraftModel | None:
    """The draft named by id or name, among those the user may see (another team's reads as no draft)."""
    if not value:
        return None
    lookup = {"pk": id_param(value, name="draft")} if is_ascii_digits(value.strip()) else {"name": value}
    draft = visible_drafts(user).filter(**lookup).first()
    if draft is None:
        raise NotFound({"draft": [f"no draft {value!r}"]})
    return draft


def _k_from(value: str | None) -> int | None:
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError as exc:
        raise ValidationError({"k": ["must be an integer"]}) from exc


class NativeFlagsView(APIView):
    """Exact vLLM / SGLang launch flags that make the endpoint's server run the draft itself.

    The draft and K default to the endpoint's policy; without a draft the flags are n-gram prompt lookup.
    """

    @extend_schema(
        parameters=[
            OpenApiParameter("draft", str, description="draft id or name (default: the policy's draft)"),
            OpenApiParameter("k", int, description="lookahead K, 1..16 (default: the policy's K)"),
        ],
        responses=_RESPONSE,
    )
    def get(self, request: Request, pk: int) -> Response:
        endpoint = endpoint_for(request.user, pk)
        draft = _draft_from(request.query_params.get("draft"), request.user)
        k = _k_from(request.query_params.get("k"))
        try:
            flags = native_flags.flags_for_endpoint(endpoint=endpoint, draft=draft, k=k)
        except native_flags.NativeFlagsError as exc:
            raise ValidationError({"detail": [str(exc)]}) from exc
        body = flags.as_dict()
        body["draft"] = draft.name if draft is not None else None
        return Response(body)
