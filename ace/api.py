"""REST plumbing shared by the apps: strict input serializers, the /api/v1/ root, access to the API docs."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from drf_spectacular.utils import extend_schema, inline_serializer
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerSplitView
from rest_framework import serializers
from rest_framework.permissions import BasePermission
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from ace.json_body import BodyTooLarge

API_PREFIX = "/api/v1/"


class RejectUnknownFieldsMixin:
    """A serializer that answers 400 naming every field it does not know, instead of silently ignoring it."""

    def to_internal_value(self, data):
        if isinstance(data, Mapping):
            known = set(self.fields)  # type: ignore[attr-defined]
            unknown = sorted(str(name) for name in data if name not in known)
            if unknown:
                writable = ", ".join(n for n, f in self.fields.items() if not f.read_only)  # type: ignore[attr-defined]
                raise serializers.ValidationError(
                    {name: [f"Unknown field {name!r}; the fields that can be set are: {writable}."] for name in unknown}
                )
        return super().to_internal_value(data)  # type: ignore[misc]


def exception_handler(exc: Exception, context: dict) -> Response | None:
    """DRF's handler, and a body over ACE_MAX_BODY_BYTES answered as a JSON 413 (Django alone would send its HTML
    400 page and log a traceback)."""
    if isinstance(exc, RequestDataTooBig):
        exc = BodyTooLarge.over_limit()
    return drf_exception_handler(exc, context)


@cache
def api_routes() -> list[dict[str, object]]:
    """Every REST route under /api/v1/ with its methods, from the URL configuration (as the schema sees it)."""
    from drf_spectacular.generators import EndpointEnumerator

    methods: dict[str, list[str]] = {}
    for path, _regex, method, _callback in EndpointEnumerator().get_api_endpoints():
        if path.startswith(API_PREFIX) and path != API_PREFIX:
            methods.setdefault(path, []).append(method)
    return [{"path": path, "methods": sorted(set(m))} for path, m in sorted(methods.items())]


class ApiRootView(APIView):
    """Every route of the REST API (fleet and speculation), with its methods, and where the schema lives."""

    @extend_schema(
        summary="Every route of the REST API",
        responses=inline_serializer(
            "ApiRoot",
            {
                "routes": serializers.ListField(child=serializers.DictField()),
                "schema": serializers.CharField(),
                "docs": serializers.CharField(),
            },
        ),
    )
    def get(self, request: Request) -> Response:
        return Response({"routes": api_routes(), "schema": "/api/schema/", "docs": "/api/docs/"})


class DocsAccess(BasePermission):
    """The schema and the docs: public when ACE_API_DOCS_PUBLIC is true, otherwise for signed-in users."""

    def has_permission(self, request, view) -> bool:
        return bool(settings.API_DOCS_PUBLIC or (request.user and request.user.is_authenticated))


schema_view = SpectacularAPIView.as_view(permission_classes=[DocsAccess])
_swagger_view = SpectacularSwaggerSplitView.as_view(  # its start-up script is a URL: no inline script (ace.csp)
    url_name="schema", permission_classes=[DocsAccess]
)


def docs_view(request: HttpRequest, *args, **kwargs) -> HttpResponse:
    """Swagger UI; a browser that is not signed in (and docs not public) goes to the login page first."""
    if not settings.API_DOCS_PUBLIC and not request.user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    return _swagger_view(request, *args, **kwargs)
