from django.urls import path

from speculation.web import views

app_name = "speculation"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("endpoints/<int:pk>/", views.endpoint_page, name="endpoint"),
    path("endpoints/<int:pk>/mode/", views.endpoint_mode, name="endpoint-mode"),
    path("endpoints/<int:pk>/policy/", views.endpoint_policy, name="endpoint-policy"),
    path("endpoints/<int:pk>/path/", views.endpoint_reevaluate_path, name="endpoint-path"),
    path("endpoints/<int:pk>/autopairing/apply/", views.endpoint_apply_pairing, name="endpoint-apply-pairing"),
    path("endpoints/<int:pk>/projection/", views.projection, name="projection"),
    path("drafts/", views.draft_list, name="draft-list"),
]
