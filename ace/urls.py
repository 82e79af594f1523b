from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path
from django.views.generic import RedirectView

from ace import ops
from ace.api import ApiRootView, docs_view, schema_view
from ace.login import LoginView

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="fleet:endpoint-list", permanent=False)),
    path("login/", LoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("admin/", admin.site.urls),
    path("fleet/", include("fleet.urls")),
    path("api/v1/", ApiRootView.as_view(), name="api-root"),
    path("api/v1/", include("fleet.api.urls")),
    path("api/v1/", include("speculation.web.api.urls")),
    path("v1/", include("speculation.gateway.urls")),
    path("dashboard/", include("speculation.web.urls")),
    path("api/v1/", include("speculation.web.dashboard_api")),
    path("api/schema/", schema_view, name="schema"),
    path("api/docs/", docs_view, name="api-docs"),
    path("healthz", ops.healthz, name="healthz"),
    path("readyz", ops.readyz, name="readyz"),
    path("metrics", ops.metrics, name="metrics"),
]
