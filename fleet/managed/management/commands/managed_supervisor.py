"""Run the managed-server supervisor of one node class (normally started by that node class's GPU worker)."""

from __future__ import annotations

import signal

from django.core.management.base import BaseCommand

from fleet.managed.supervisor import Supervisor


class Command(BaseCommand):
    help = "Supervise the managed model servers of one node class until SIGTERM."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--node-class", required=True)

    def handle(self, *args, **options) -> None:
        supervisor = Supervisor(node_class=options["node_class"])
        # SIGTERM (from the worker, or PR_SET_PDEATHSIG when the worker dies) stops every server first.
        signal.signal(signal.SIGTERM, lambda *_: supervisor.stop_event.set())
        signal.signal(signal.SIGINT, lambda *_: supervisor.stop_event.set())
        supervisor.run()
