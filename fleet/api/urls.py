from django.urls import path
from rest_framework.routers import SimpleRouter

from fleet.api.views import EndpointViewSet, ProbeViewSet
from fleet.managed.api import ManagedBaselineView, ManagedEndpointCreateView, ManagedStateView

app_name = "fleet-api"

router = SimpleRouter()
router.register("endpoints", EndpointViewSet, basename="endpoint")
router.register("probes", ProbeViewSet, basename="probe")

urlpatterns = [
    path("managed-endpoints/", ManagedEndpointCreateView.as_view(), name="managed-endpoint-create"),
    path("endpoints/<int:pk>/managed/", ManagedStateView.as_view(), name="endpoint-managed"),
    path("endpoints/<int:pk>/managed/baseline/", ManagedBaselineView.as_view(), name="endpoint-managed-baseline"),
    *router.urls,
]
