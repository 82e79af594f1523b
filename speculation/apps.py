from django.apps import AppConfig


class SpeculationConfig(AppConfig):
    name = "speculation"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # the gateway's routing table is invalidated when endpoints or policies change
        from speculation import signals

        signals.connect()
