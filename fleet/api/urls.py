from rest_framework.routers import SimpleRouter

from fleet.api.views import EndpointViewSet, ProbeViewSet

app_name = "fleet-api"

router = SimpleRouter()
router.register("endpoints", EndpointViewSet, basename="endpoint")
router.register("probes", ProbeViewSet, basename="probe")

urlpatterns = router.urls
