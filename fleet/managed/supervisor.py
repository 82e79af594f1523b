"""The supervisor of one node class's managed servers: a small loop in its own process.

Who owns the servers: the GPU worker of a node class (a `celery worker` consuming `gpu.<class>`) starts one
supervisor process from its main process when it is ready (fleet.managed.worker_hook), and that process
starts every server instance of the node class as its own child, in its own process group, set to receive
SIGTERM when the supervisor dies (PR_SET_PDEATHSIG, ace.processes.spawn). Celery's pool processes never own
a server: they are recycled and forked, a long-lived child must not depend on them. One supervisor per node
class holds a Redis lease (LEASE_KEY); a second worker of the same class waits as a spare.

Every TICK_S the loop reconciles the database with its children:
- an endpoint with no live active instance gets one (after the backoff of its consecutive failures);
- a starting instance that answers /v1/models is probed like any endpoint (fleet.adapters) and routed;
- a child that exited is recorded (exit code, log tail) and restarted with backoff;
- a pending switch starts a standby instance with the new speculation; once ready, probed and (when it
  speculates) through the switch canary (fleet.managed.canary: its greedy answers in a mixed batch must be
  the plain server's) the route moves (fleet.managed.switching.complete_switch), and the old instance drains
  until the server has reported no running or waiting request for DRAIN_QUIET_S, then stops. A standby that
  exits, times out or fails the canary rolls the switch back (the endpoint keeps its instance);
- a child whose instance row is gone (its endpoint was deleted) is stopped.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from ace import processes
from fleet.adapters import Unsupported, adapter_for, wire_for
from fleet.adapters.base import FailureKind
from fleet.managed import args as server_args
from fleet.managed import baseline, canary, switching
from fleet.managed.models import (
    LIVE_STATES,
    EventKind,
    InstanceRole,
    InstanceState,
    ManagedServer,
    ServerInstance,
    Switch,
    SwitchStatus,
)
from fleet.managed.services import record_event, spec_args
from fleet.models import EndpointStatus
from fleet.probing import summarize

logger = logging.getLogger(__name__)

TICK_S = 1.0
START_TIMEOUT_S = float(os.environ.get("ACE_MANAGED_START_TIMEOUT", "600"))
DRAIN_GRACE_S = 2.0  # a gateway that looked the route up just before it moved may still connect to the old one
# Idle this long before the stop: vLLM counts a request in its gauges from its first engine step only, so a request
# the old instance accepted a moment ago reads as 0 for up to a step (seconds on a loaded CPU).
DRAIN_QUIET_S = 3.0
DRAIN_TIMEOUT_S = 600.0
IN_FLIGHT_TIMEOUT_S = 10.0  # a loaded server answers /metrics slowly; a read that fails is not an idle server
BACKOFF_MAX_S = 60.0
LOG_TAIL_LINES = 40
LEASE_KEY = "ace:managed:supervisor:{node_class}"
LEASE_S = 15


def last_error(tail: str) -> str:
    """The server's last error line in its log tail ("" when none), to say why it did not start."""
    for line in reversed(tail.splitlines()):
        text = line.strip()
        if "Error" in text or "error:" in text.lower():
            return text[-300:]
    return ""


def backoff_s(failures: int) -> float:
    """1, 2, 4, ... seconds after each consecutive failure, at most BACKOFF_MAX_S."""
    return min(BACKOFF_MAX_S, 2.0 ** max(0, failures - 1))


def in_flight(base_url: str, kind: str) -> float | None:
    """Requests the instance is running or queueing, as its server kind reports them: 0 when it never can say (its
    kind has no such figure, or no /metrics), None when it did not answer now (busy until it says otherwise)."""
    wire = wire_for(kind)
    try:
        request = wire.in_flight()
    except Unsupported:
        return 0.0
    try:
        response = httpx.request(request.method, base_url + request.path, timeout=IN_FLIGHT_TIMEOUT_S)
    except httpx.HTTPError:
        return None
    if response.status_code == 404:
        return 0.0
    return wire.parse_in_flight(response.text) if response.status_code == 200 else None


class Supervisor:
    def __init__(self, *, node_class: str, log_dir: Path | None = None, host: str | None = None) -> None:
        self.node_class = node_class
        self.log_dir = log_dir or Path(settings.DATA_DIR) / "logs" / "managed"
        self.host = host or getattr(settings, "MANAGED_HOST", "127.0.0.1")
        self.children: dict[int, processes.ManagedProcess] = {}
        self.stop_event = threading.Event()
        self._idle_since: dict[int, float] = {}  # draining instance -> when it was first seen idle (monotonic)
        self._lease_holder = f"{socket.gethostname()}:{os.getpid()}"
        self._redis: Any = None

    # --- the loop -------------------------------------------------------------------------------------------

    def run(self) -> None:
        logger.info("managed supervisor for node class %s started (pid %s)", self.node_class, os.getpid())
        recovered = False
        try:
            while not self.stop_event.is_set():
                close_old_connections()
                if self._hold_lease():
                    if not recovered:
                        self.recover()
                        recovered = True
                    try:
                        self.tick()
                    except Exception:  # one bad tick must not end supervision of every server
                        logger.exception("managed supervisor tick failed")
                self.stop_event.wait(TICK_S)
        finally:
            self.stop_all()
            self._release_lease()

    def _release_lease(self) -> None:
        """Let a spare supervisor of the node class take over at once."""
        import redis

        if self._redis is None:
            return
        key = LEASE_KEY.format(node_class=self.node_class)
        try:
            if (self._redis.get(key) or b"").decode() == self._lease_holder:
                self._redis.delete(key)
        except redis.RedisError:
            pass

    def _hold_lease(self) -> bool:
        import redis

        try:
            if self._redis is None:
                self._redis = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
            key = LEASE_KEY.format(node_class=self.node_class)
            if self._redis.set(key, self._lease_holder, nx=True, ex=LEASE_S):
                return True
            if (self._redis.get(key) or b"").decode() == self._lease_holder:
                self._redis.expire(key, LEASE_S)
                return True
            return False
        except redis.RedisError as exc:
            # No Redis, no second supervisor to tell apart from: carry on (one machine).
            logger.debug("supervisor lease unavailable: %s", exc)
            return True

    @contextmanager
    def _lease_kept(self) -> Iterator[None]:
        """Renew the lease while a long step (canary, baseline) blocks the loop, so that a spare supervisor of
        the node class does not take over meanwhile."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(LEASE_S / 3):
                self._hold_lease()

        thread = threading.Thread(target=renew, name="lease-renewal", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def recover(self) -> None:
        """At start: instances recorded live have no process any more (they died with the last supervisor)."""
        stale = ServerInstance.objects.filter(managed__endpoint__node_class=self.node_class, state__in=LIVE_STATES)
        for instance in stale.exclude(pk__in=list(self.children)):
            self._close(instance, InstanceState.STOPPED, "stopped with the previous supervisor")
        Switch.objects.filter(managed__endpoint__node_class=self.node_class, status=SwitchStatus.STARTING).update(
            status=SwitchStatus.PENDING, instance=None
        )

    def tick(self) -> None:
        self._stop_orphans()
        for managed in ManagedServer.objects.filter(endpoint__node_class=self.node_class).select_related("endpoint"):
            self._reconcile(managed)

    def stop_all(self) -> None:
        for instance_id, proc in list(self.children.items()):
            proc.stop()
            ServerInstance.objects.filter(pk=instance_id, state__in=LIVE_STATES).update(
                state=InstanceState.STOPPED, stopped_at=timezone.now(), reason="supervisor stopped"
            )
        self.children.clear()

    # --- one managed endpoint -------------------------------------------------------------------------------

    def _reconcile(self, managed: ManagedServer) -> None:
        live = list(managed.instances.filter(state__in=LIVE_STATES))
        for instance in live:
            proc = self.children.get(instance.pk)
            if proc is None or not proc.alive():
                self._exited(managed, instance, proc)
        live = [i for i in live if i.pk in self.children]
        active = next((i for i in live if i.role == InstanceRole.ACTIVE), None)
        standby = next((i for i in live if i.role == InstanceRole.STANDBY), None)
        if active is None:
            if managed.next_start_at is None or timezone.now() >= managed.next_start_at:
                self._start(managed, InstanceRole.ACTIVE, managed.serving_speculation or {})
        elif active.state == InstanceState.STARTING:
            self._check_starting_active(managed, active)
        self._advance_switch(managed, active, standby)
        if active is not None:
            self._maybe_measure_baseline(managed, active)
        for instance in live:
            if instance.role == InstanceRole.DRAINING:
                self._drain(instance)

    def _start(self, managed: ManagedServer, role: str, speculation: dict) -> ServerInstance | None:
        port = processes.free_port(self.host)
        argv = server_args.build_argv(
            kind=managed.server_kind,
            model_dir=managed.model_dir,
            served_name=managed.served_name,
            host=self.host,
            port=port,
            args=managed.server_args or {},
            spec_args=spec_args(server_kind=managed.server_kind, speculation=speculation),
        )
        instance = ServerInstance.objects.create(
            managed=managed, role=role, speculation=speculation, argv=argv, host=self.host, port=port
        )
        log_path = self.log_dir / f"{managed.endpoint.name}-{instance.pk}-{port}.log"
        try:
            proc = processes.spawn(
                f"managed-{managed.endpoint.name}",
                argv,
                log_path=log_path,
                env=server_args.server_env(managed.server_kind),
            )
        except OSError as exc:
            self._close(instance, InstanceState.FAILED, f"could not start: {exc}")
            self._failed(managed, f"could not start the server: {exc}", "")
            return None
        self.children[instance.pk] = proc
        ServerInstance.objects.filter(pk=instance.pk).update(pid=proc.pid, log_path=str(log_path))
        what = f"speculation {speculation}" if speculation else "no speculation"
        record_event(
            managed,
            EventKind.STARTED,
            f"{role} instance on port {port} with {what} (pid {proc.pid})",
            instance=instance,
        )
        return instance

    def _ready(self, instance: ServerInstance) -> bool:
        return processes.http_ok(instance.base_url + "/v1/models")

    def _probe(self, managed: ManagedServer, instance: ServerInstance):
        started = timezone.now()
        t0 = time.perf_counter()
        report = adapter_for(managed.endpoint.kind, base_url=instance.base_url).probe()
        return report, (time.perf_counter() - t0) * 1000, started

    def _timed_out(self, instance: ServerInstance) -> bool:
        return timezone.now() - instance.started_at > timedelta(seconds=START_TIMEOUT_S)

    def _warming_up(self, instance: ServerInstance, report) -> bool:
        """A starting server that lists its models but whose generations only timed out is still warming up (a
        cold CPU server's first requests can take longer than the probe's timeout): probed again next tick, until
        the start timeout, instead of being killed and restarted from cold."""
        kinds = {e.get("kind") for e in report.errors}
        return report.fatal is None and kinds == {str(FailureKind.TIMEOUT)} and not self._timed_out(instance)

    def _check_starting_active(self, managed: ManagedServer, active: ServerInstance) -> None:
        if self._ready(active):
            report, duration_ms, started = self._probe(managed, active)
            outcome, reason = summarize(report)
            if outcome == EndpointStatus.READY:
                switching.activate(instance=active, report=report, duration_ms=duration_ms, started=started)
                return
            if self._warming_up(active, report):
                logger.info("instance %s of %s still warming up: %s", active.pk, managed.endpoint.name, reason)
                return
            why = f"answers but its probe failed: {reason}"
        elif self._timed_out(active):
            why = f"not serving within {START_TIMEOUT_S:.0f} s"
        else:
            return
        tail = self._tail(active.pk)
        self._kill(active, InstanceState.FAILED, why)
        self._failed(managed, why, tail)

    def _exited(self, managed: ManagedServer, instance: ServerInstance, proc) -> None:
        code = proc.popen.returncode if proc is not None else None
        tail = proc.log_tail(LOG_TAIL_LINES) if proc is not None else ""
        self.children.pop(instance.pk, None)
        if code is not None and code < 0:
            why = f"killed by signal {-code}"
        elif code is not None:
            why = f"exited with code {code}"
        else:
            why = "its process is gone (supervisor restarted)"
        state = InstanceState.EXITED if instance.state == InstanceState.READY else InstanceState.FAILED
        self._close(instance, state, why, exit_code=code)
        if instance.role == InstanceRole.DRAINING:
            return
        if instance.role == InstanceRole.STANDBY:
            switch = Switch.objects.filter(instance=instance, status=SwitchStatus.STARTING).first()
            if switch is not None:
                error = last_error(tail)
                reason = f"the new instance {why}" + (f": {error}" if error else "")
                switching.fail_switch(switch=switch, reason=reason, log_tail=tail, instance=instance)
            return
        record_event(
            managed,
            EventKind.EXITED,
            f"instance {instance.pk} on port {instance.port} {why}",
            exit_code=code,
            log_tail=tail,
            instance=instance,
        )
        self._failed(managed, f"managed server {why}", tail)

    def _failed(self, managed: ManagedServer, why: str, tail: str) -> None:
        failures = managed.failures + 1
        delay = backoff_s(failures)
        managed.failures = failures
        managed.next_start_at = timezone.now() + timedelta(seconds=delay)
        ManagedServer.objects.filter(pk=managed.pk).update(failures=failures, next_start_at=managed.next_start_at)
        record_event(managed, EventKind.RESTARTING, f"{why}; restart {failures} in {delay:.0f} s", log_tail=tail)
        switching.mark_down(managed=managed, reason=f"{why}; restarting in {delay:.0f} s")

    def _maybe_measure_baseline(self, managed: ManagedServer, active: ServerInstance) -> None:
        """Measure the plain baseline on a serving instance without speculation, when none is kept or asked."""
        active.refresh_from_db(fields=["state"])
        if active.state != InstanceState.READY or active.speculation:
            return
        if managed.baseline.get("buckets") and not managed.baseline_requested:
            return
        if managed.switches.filter(status__in=[SwitchStatus.PENDING, SwitchStatus.STARTING]).exists():
            return
        try:
            with self._lease_kept():
                buckets = baseline.measure(
                    base_url=active.base_url, kind=managed.server_kind, model=managed.served_name
                )
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            logger.warning("baseline of %s not measured: %s", managed.endpoint.name, exc)
            ManagedServer.objects.filter(pk=managed.pk).update(baseline_requested=False)
            return
        switching.keep_baseline(managed=managed, instance=active, buckets=buckets)

    # --- switches ---------------------------------------------------------------------------------------------

    def _advance_switch(self, managed: ManagedServer, active, standby) -> None:
        switch = managed.switches.filter(status__in=[SwitchStatus.PENDING, SwitchStatus.STARTING]).first()
        if switch is None:
            return
        if switch.status == SwitchStatus.PENDING:
            if active is None or active.state != InstanceState.READY:
                if timezone.now() - switch.created_at > timedelta(seconds=START_TIMEOUT_S):
                    switching.fail_switch(switch=switch, reason="no serving instance to switch from")
                return
            instance = self._start(managed, InstanceRole.STANDBY, switch.speculation)
            if instance is None:
                switching.fail_switch(switch=switch, reason="the new instance could not be started")
                return
            Switch.objects.filter(pk=switch.pk).update(status=SwitchStatus.STARTING, instance=instance)
            record_event(
                managed,
                EventKind.SWITCH_STARTED,
                f"switch {switch.pk}: instance {instance.pk} starting beside instance {active.pk}",
                instance=instance,
            )
            return
        if standby is None or standby.pk != switch.instance_id:
            switching.fail_switch(switch=switch, reason="the new instance is gone")
            return
        if self._ready(standby):
            report, duration_ms, started = self._probe(managed, standby)
            outcome, reason = summarize(report)
            if outcome != EndpointStatus.READY and self._warming_up(standby, report):
                logger.info("instance %s of %s still warming up: %s", standby.pk, managed.endpoint.name, reason)
            elif outcome != EndpointStatus.READY:
                self._abort_switch(switch, standby, f"the new instance answers but its probe failed: {reason}")
            elif switch.speculation and not report.capabilities.get("native_speculation"):
                self._abort_switch(switch, standby, "the new instance does not report speculative decoding")
            else:
                self._route_after_canary(managed, switch, active, standby, (report, duration_ms, started))
        elif self._timed_out(standby):
            self._abort_switch(switch, standby, f"the new instance was not serving within {START_TIMEOUT_S:.0f} s")

    def _route_after_canary(self, managed: ManagedServer, switch: Switch, active, standby, probed: tuple) -> None:
        """Move the route to the probed standby, unless the switch canary (fleet.managed.canary) refuses it: then
        the switch is rolled back and the endpoint keeps serving from its active instance."""
        record = dict(switch.canary or {}) or canary.requested(settings.MANAGED_SWITCH_CANARY, switch.speculation)
        if record.get("outcome") == canary.PENDING:
            old_plain = active.base_url if active is not None and not active.speculation else None
            with self._lease_kept():  # 14-53 s on a loaded CPU, longer than the lease
                result = canary.run(new_url=standby.base_url, model=managed.served_name, old_url=old_plain)
            record = result.record()
            if result.refused:
                serving = f"speculation {active.speculation}" if active and active.speculation else "no speculation"
                where = f"instance {active.pk} ({serving})" if active is not None else "the instance it had"
                reason = f"{result.reason}. Switch refused: the endpoint stays on {where}"
                self._abort_switch(switch, standby, reason, canary_record=record)
                return
        report, duration_ms, started = probed
        switching.complete_switch(
            switch=switch,
            instance=standby,
            old=active,
            report=report,
            duration_ms=duration_ms,
            started=started,
            canary=record,
        )

    def _abort_switch(
        self, switch: Switch, standby: ServerInstance, reason: str, canary_record: dict[str, Any] | None = None
    ) -> None:
        tail = self._tail(standby.pk)
        self._kill(standby, InstanceState.FAILED, reason)
        switching.fail_switch(switch=switch, reason=reason, log_tail=tail, instance=standby, canary=canary_record)

    def _drain(self, instance: ServerInstance) -> None:
        """Stop the old instance once it has served nothing for DRAIN_QUIET_S (reads that fail count as busy), or
        at DRAIN_TIMEOUT_S: a stream still running on it would be cut."""
        since = instance.draining_since or timezone.now()
        waited = (timezone.now() - since).total_seconds()
        if waited < DRAIN_GRACE_S:
            return
        busy = in_flight(instance.base_url, instance.managed.server_kind)
        if waited < DRAIN_TIMEOUT_S:
            if busy is None or busy > 0:
                self._idle_since.pop(instance.pk, None)
                return
            idle_since = self._idle_since.setdefault(instance.pk, time.monotonic())
            if time.monotonic() - idle_since < DRAIN_QUIET_S:
                return
        if busy == 0:
            why = "drained"
        elif busy is None:
            why = "drain timeout (its requests in flight could not be read)"
        else:
            why = f"drain timeout ({busy:.0f} requests still in flight)"
        self._idle_since.pop(instance.pk, None)
        self._kill(instance, InstanceState.STOPPED, why)
        record_event(
            instance.managed, EventKind.STOPPED, f"old instance {instance.pk} stopped: {why}", instance=instance
        )

    # --- processes ---------------------------------------------------------------------------------------------

    def _tail(self, instance_id: int) -> str:
        proc = self.children.get(instance_id)
        return proc.log_tail(LOG_TAIL_LINES) if proc is not None else ""

    def _kill(self, instance: ServerInstance, state: str, reason: str) -> None:
        proc = self.children.pop(instance.pk, None)
        code = None
        if proc is not None:
            proc.stop()
            code = proc.popen.returncode
        self._close(instance, state, reason, exit_code=code)

    def _close(self, instance: ServerInstance, state: str, reason: str, exit_code: int | None = None) -> None:
        ServerInstance.objects.filter(pk=instance.pk).update(
            state=state, reason=reason[:2000], stopped_at=timezone.now(), exit_code=exit_code
        )

    def _stop_orphans(self) -> None:
        """Children whose instance row is gone: their endpoint was deleted."""
        if not self.children:
            return
        known = set(ServerInstance.objects.filter(pk__in=list(self.children)).values_list("pk", flat=True))
        for instance_id in [i for i in self.children if i not in known]:
            logger.info("managed instance %s: its endpoint was deleted, stopping it", instance_id)
            self.children.pop(instance_id).stop()
