"""Where the worker's engine runs relative to the endpoint's server, read from the capacity the live workers declare
(speculation.jobs.admission): whether it shares the server's machine (a speculating request then takes the cores its
plain neighbours wait for) and whether its batch takes a whole load at once. Kept SHARED_TTL_S per process."""

from __future__ import annotations

import functools
import ipaddress
import socket
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings

from speculation.gateway.admission import single_stream
from speculation.gateway.channel import client
from speculation.jobs.admission import workers_key

SHARED_TTL_S = 30.0  # how long the gateway keeps its finding per (node class, server host)
_now = time.monotonic
_shared: dict[tuple[str, str], tuple[float, bool]] = {}
_workers: dict[str, tuple[float, list]] = {}  # node class -> (when read, its live workers' capacity members)


@functools.cache
def _this_machine() -> frozenset[str]:
    """This host's names and addresses, looked up once per process (the lookups may ask DNS)."""
    names = {socket.gethostname().lower()}
    try:
        names.add(socket.getfqdn().lower())
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return frozenset(names)


def server_on_this_machine(base_url: str) -> bool:
    """Whether the endpoint's server runs on the machine of this web process: a loopback address or this host."""
    host = (urlsplit(base_url).hostname or "").lower()
    if host == "localhost":
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    return host in _this_machine()


def worker_machines(members: Sequence[bytes | str]) -> set[str]:
    """The machines of the capacity members "<celery node name>|<slots>" (speculation.jobs.admission): a node name
    is "<name>@<host>" (Celery's default is "celery@<hostname>")."""
    machines = set()
    for member in members:
        text = member.decode() if isinstance(member, bytes) else member
        node = text.rsplit("|", 1)[0]
        machines.add(node.rpartition("@")[2].lower())
    return machines


async def shares_machine(route: Any) -> bool:
    """Whether the worker's engine would run on the same machine as the endpoint's server: the server is on this
    machine and a live worker of the endpoint's node class declares capacity from this machine. Kept SHARED_TTL_S."""
    if getattr(settings, "GOODPUT_SHARED_LEARN", False):
        return False
    key, now = (route.node_class, route.base_url), _now()
    found = _shared.get(key)
    if found is not None and now - found[0] < SHARED_TTL_S:
        return found[1]
    if not server_on_this_machine(route.base_url):
        _shared[key] = (now, False)
        return False
    shared = bool(worker_machines(await live_workers(route.node_class)) & _this_machine())
    _shared[key] = (now, shared)
    return shared


async def live_workers(node_class: str) -> list:
    """The capacity members "<node>|<slots>" the live workers of a node class declare to admission control, read
    once per SHARED_TTL_S for shares_machine and batch_takes alike."""
    now = _now()
    found = _workers.get(node_class)
    if found is None or now - found[0] >= SHARED_TTL_S:
        found = _workers[node_class] = (now, await client().zrangebyscore(workers_key(node_class), time.time(), "+inf"))
    return found[1]


def slots(members: Sequence[bytes | str]) -> int:
    total = 0
    for member in members:
        count = (member.decode() if isinstance(member, bytes) else member).rpartition("|")[2]
        total += int(count) if count.isdigit() else 0
    return total


def batch_takes_known(node_class: str, load: int) -> bool:
    """batch_takes on the workers read last (no Redis round trip): False where none were read."""
    read = _workers.get(node_class)
    return read is not None and slots(read[1]) >= load


async def batch_takes(route: Any, load: int) -> bool:
    """Whether the worker's batch serves this endpoint's prod requests (admission.single_stream says it does not)
    and its live workers' slots take a load of this many requests at once: then every request of the load can
    speculate together and the server sits idle, instead of a few speculating beside plain ones."""
    if load <= 1 or single_stream(path=route.path, mechanism=route.mechanism):
        return False
    return slots(await live_workers(route.node_class)) >= load
