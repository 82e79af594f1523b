"""A GPU worker starts the managed-server supervisor of each node class it consumes (gpu.<class>).

Connected in ace.celery. The supervisor is a child of the worker's main process (its own process group,
SIGTERM when the worker dies: ace.processes.spawn), stopped on worker shutdown. ACE_MANAGED_SUPERVISOR=false
turns it off (then run `manage.py managed_supervisor --node-class X` yourself, or manage nothing).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from celery.signals import worker_ready, worker_shutdown

logger = logging.getLogger(__name__)

GPU_PREFIX = "gpu."
_children: list = []


def enabled() -> bool:
    return os.environ.get("ACE_MANAGED_SUPERVISOR", "true").strip().lower() not in ("0", "false", "no", "off")


@worker_ready.connect
def start_supervisors(sender=None, **_: object) -> None:
    if not enabled() or sender is None:
        return
    from django.conf import settings

    from ace import processes

    queues = sorted(q.name for q in getattr(sender.task_consumer, "queues", []) or [])
    log_dir = Path(settings.DATA_DIR) / "logs"
    for queue in queues:
        node_class = queue[len(GPU_PREFIX) :]
        if not queue.startswith(GPU_PREFIX) or "." in node_class:  # not gpu.<class>.background (ace.celery)
            continue
        argv = [
            sys.executable,
            str(processes.REPO_ROOT / "manage.py"),
            "managed_supervisor",
            "--node-class",
            node_class,
        ]
        _children.append(
            processes.spawn(
                f"managed-supervisor-{node_class}",
                argv,
                log_path=log_dir / f"managed-supervisor-{node_class}-{os.getpid()}.log",
            )
        )
        logger.info("managed supervisor for node class %s started", node_class)


@worker_shutdown.connect
def stop_supervisors(**_: object) -> None:
    while _children:
        _children.pop().stop(grace_s=30)
