from django.urls import path
from rest_framework.routers import SimpleRouter

from speculation.web.api import views
from speculation.web.api.autopairing import AutoPairingApplyView, AutoPairingView
from speculation.web.api.captures import CaptureSettingView, CapturesView
from speculation.web.api.native_flags import NativeFlagsView
from speculation.web.api.training_runs import TrainingRunViewSet

app_name = "speculation-api"

router = SimpleRouter()
router.register("drafts", views.DraftViewSet, basename="draft")
router.register("stage-records", views.StageRecordViewSet, basename="stage-record")
router.register("training-runs", TrainingRunViewSet, basename="training-run")

urlpatterns = [
    path("endpoints/<int:pk>/policy/", views.PolicyView.as_view(), name="policy"),
    path("endpoints/<int:pk>/policy/path/", views.PolicyPathView.as_view(), name="policy-path"),
    path("endpoints/<int:pk>/policy/changes/", views.PolicyChangesView.as_view(), name="policy-changes"),
    path("endpoints/<int:pk>/native-flags/", NativeFlagsView.as_view(), name="native-flags"),
    path("endpoints/<int:pk>/autopairing/", AutoPairingView.as_view(), name="autopairing"),
    path("endpoints/<int:pk>/autopairing/apply/", AutoPairingApplyView.as_view(), name="autopairing-apply"),
    path("endpoints/<int:pk>/capture/", CaptureSettingView.as_view(), name="capture"),
    path("endpoints/<int:pk>/captures/", CapturesView.as_view(), name="captures"),
    *router.urls,
]
