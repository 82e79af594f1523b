from django.urls import path

from fleet import views
from fleet.managed import views as managed_views

app_name = "fleet"
urlpatterns = [
    path("", views.endpoint_list, name="endpoint-list"),
    path("rows/", views.endpoint_rows, name="endpoint-rows"),
    path("new/", views.endpoint_create, name="endpoint-create"),
    path("managed/new/", managed_views.managed_create, name="managed-create"),
    path("<int:pk>/", views.endpoint_detail, name="endpoint-detail"),
    path("<int:pk>/status/", views.endpoint_status, name="endpoint-status"),
    path("<int:pk>/edit/", views.endpoint_edit, name="endpoint-edit"),
    path("<int:pk>/delete/", views.endpoint_delete, name="endpoint-delete"),
    path("<int:pk>/probe/", views.endpoint_probe, name="endpoint-probe"),
]
