"""The Celery app, configured from Django settings (CELERY_* names)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

app = Celery("ace")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # each installed app's `tasks` module (fleet.tasks)
app.autodiscover_tasks(["speculation.worker"])  # the stage's tasks live with the worker code

from ace import heartbeat  # noqa: E402, F401 - connects the worker heartbeat (worker_ready / worker_shutdown)
from fleet.managed import worker_hook  # noqa: E402, F401 - GPU workers start the managed-server supervisor


def gpu_queue(node_class: str) -> str:
    """The queue a node class's GPU worker pool consumes."""
    return f"gpu.{node_class}"
