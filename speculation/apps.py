from django.apps import AppConfig


class SpeculationConfig(AppConfig):
    name = "speculation"
    default_auto_field = "django.db.models.BigAutoField"
