from rest_framework.routers import DefaultRouter

from fleet.api.views import EndpointViewSet, ProbeViewSet

app_name = "fleet-api"

router = DefaultRouter()
router.register("endpoints", EndpointViewSet, basename="endpoint")
router.register("probes", ProbeViewSet, basename="probe")

urlpatterns = router.urls
