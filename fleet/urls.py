from django.urls import path

app_name = "fleet"
urlpatterns: list = []
