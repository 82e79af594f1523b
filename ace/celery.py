"""The Celery app, configured from Django settings (CELERY_* names).

Queues: `control` (probes, rollups), and per GPU node class `gpu.<class>` (prod and shadow measurement) and
`gpu.<class>.background` (cost calibrations and auto-pairing's candidate replays: work that may take minutes on a
loaded node, kept off the queue prod jobs wait on). A worker that consumes `gpu.<class>` also consumes that class's
background queue (added when the worker starts, however it was started), and a background task yields to prod and
shadow work waiting on `gpu.<class>` (speculation.worker.tasks).
"""

import os

from celery import Celery
from celery.signals import celeryd_after_setup

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")

app = Celery("ace")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()  # each installed app's `tasks` module (fleet.tasks)
app.autodiscover_tasks(["speculation.worker"])  # the stage's tasks live with the worker code

from ace import heartbeat  # noqa: E402, F401 - connects the worker heartbeat (worker_ready / worker_shutdown)
from fleet.managed import worker_hook  # noqa: E402, F401 - GPU workers start the managed-server supervisor

GPU_PREFIX = "gpu."
BACKGROUND_SUFFIX = ".background"


def gpu_queue(node_class: str) -> str:
    """The queue a node class's GPU worker pool consumes (prod jobs, shadow measurements)."""
    return f"{GPU_PREFIX}{node_class}"


def background_queue(node_class: str) -> str:
    """The node class's low-priority queue (calibrations, candidate replays), consumed by the same workers."""
    return f"{GPU_PREFIX}{node_class}{BACKGROUND_SUFFIX}"


def node_class_of(queue: str) -> str | None:
    """The node class of a `gpu.<class>` queue; None for any other queue (`control`, `gpu.<class>.background`).
    Node class names hold no dot (fleet.services), so the two GPU queue kinds never collide."""
    if not queue.startswith(GPU_PREFIX):
        return None
    node_class = queue[len(GPU_PREFIX) :]
    return node_class if node_class and "." not in node_class else None


@celeryd_after_setup.connect
def _consume_background_queues(sender: str, instance, **_: object) -> None:
    """A worker consuming gpu.<class> consumes gpu.<class>.background too (`celery worker -Q gpu.h100` is enough)."""
    queues = instance.app.amqp.queues
    for name in list(queues.consume_from or {}):
        node_class = node_class_of(name)
        if node_class is not None:  # bound like a -Q queue: its own direct exchange, its name as the routing key
            name = background_queue(node_class)
            queues.select_add(name, exchange=name, routing_key=name)
