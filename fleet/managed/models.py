"""Managed endpoints: the launch spec of a model server ACE runs itself, its instances, events and switches.

A ManagedServer is linked 1:1 to a fleet Endpoint. The supervisor of its node class (fleet.managed.supervisor)
runs one active ServerInstance (the one the endpoint's base_url points at), and during a policy change a
standby instance beside it; the old one drains and stops. Every start, exit, restart and switch is a
ServerEvent, shown on the endpoint page.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models


class ManagedKind(models.TextChoices):
    VLLM = "vllm", "vLLM"
    SGLANG = "sglang", "SGLang"


class ManagedServer(models.Model):
    endpoint = models.OneToOneField("fleet.Endpoint", related_name="managed", on_delete=models.CASCADE)
    server_kind = models.CharField(max_length=16, choices=ManagedKind.choices, default=ManagedKind.VLLM)
    model_dir = models.CharField(max_length=1000)
    served_name = models.CharField(max_length=255)
    # The arguments a user sets (fleet.managed.args.ALLOWED_ARGS), validated: {"dtype": "float32", ...}.
    server_args = models.JSONField(default=dict, blank=True)
    # The speculation the active instance runs ({} = none): {"draft_kind", "draft_path", "k"}.
    serving_speculation = models.JSONField(default=dict, blank=True)
    # Consecutive failed starts / exits; the supervisor backs off exponentially and resets it once ready.
    failures = models.PositiveIntegerField(default=0)
    # Native multiplier baseline (fleet.managed.baseline): {"buckets": {"1": tok/s, ...}, "measured_at", "instance"}.
    baseline = models.JSONField(default=dict, blank=True)
    baseline_requested = models.BooleanField(default=False)
    next_start_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"managed {self.server_kind} for {self.endpoint_id}"


class InstanceRole(models.TextChoices):
    ACTIVE = "active", "Active"  # the one the route points at (or will, once ready)
    STANDBY = "standby", "Standby"  # started for a switch, not routed yet
    DRAINING = "draining", "Draining"  # routed away; finishing in-flight requests


# Where a managed endpoint points until its first instance serves: port 0 never answers.
NOT_STARTED_URL = "http://127.0.0.1:0"


class InstanceState(models.TextChoices):
    STARTING = "starting", "Starting"
    READY = "ready", "Ready"
    STOPPED = "stopped", "Stopped"
    EXITED = "exited", "Exited"
    FAILED = "failed", "Failed"


LIVE_STATES = (InstanceState.STARTING, InstanceState.READY)


class ServerInstance(models.Model):
    managed = models.ForeignKey(ManagedServer, related_name="instances", on_delete=models.CASCADE)
    role = models.CharField(max_length=16, choices=InstanceRole.choices)
    state = models.CharField(max_length=16, choices=InstanceState.choices, default=InstanceState.STARTING)
    speculation = models.JSONField(default=dict, blank=True)
    argv = models.JSONField(default=list, blank=True)
    host = models.CharField(max_length=255, default="127.0.0.1")
    port = models.PositiveIntegerField(null=True, blank=True)
    pid = models.PositiveIntegerField(null=True, blank=True)
    log_path = models.CharField(max_length=1000, blank=True, default="")
    started_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    draining_since = models.DateTimeField(null=True, blank=True)
    stopped_at = models.DateTimeField(null=True, blank=True)
    exit_code = models.IntegerField(null=True, blank=True)
    reason = models.TextField(blank=True, default="")

    class Meta:
        ordering = ["-id"]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}" if self.port else ""

    def __str__(self) -> str:
        return f"instance {self.pk} ({self.role}, {self.state}) of {self.managed_id}"


class EventKind(models.TextChoices):
    STARTED = "started", "Started"
    READY = "ready", "Ready"
    EXITED = "exited", "Exited"
    START_FAILED = "start_failed", "Start failed"
    RESTARTING = "restarting", "Restarting"
    SWITCH_STARTED = "switch_started", "Switch started"
    SWITCHED = "switched", "Switched"
    SWITCH_FAILED = "switch_failed", "Switch failed"
    STOPPED = "stopped", "Stopped"
    BASELINE = "baseline", "Baseline measured"


class ServerEvent(models.Model):
    managed = models.ForeignKey(ManagedServer, related_name="events", on_delete=models.CASCADE)
    instance = models.ForeignKey(ServerInstance, null=True, blank=True, on_delete=models.SET_NULL)
    kind = models.CharField(max_length=16, choices=EventKind.choices)
    message = models.TextField(blank=True, default="")
    exit_code = models.IntegerField(null=True, blank=True)
    log_tail = models.TextField(blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]


class SwitchStatus(models.TextChoices):
    PENDING = "pending", "Pending"
    STARTING = "starting", "Starting the new instance"
    DONE = "done", "Done"
    FAILED = "failed", "Failed (rolled back)"


class Switch(models.Model):
    """A policy change that changes how the server runs: applied when the new instance serves (blue/green)."""

    managed = models.ForeignKey(ManagedServer, related_name="switches", on_delete=models.CASCADE)
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    # The policy fields to apply once the new instance serves ({"mode": "prod", "draft": <id or None>, ...}) and
    # the {field: [old, new]} changes the request made (what the policy history records).
    fields = models.JSONField(default=dict)
    changes = models.JSONField(default=dict)
    speculation = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=SwitchStatus.choices, default=SwitchStatus.PENDING)
    reason = models.TextField(blank=True, default="")
    # The switch canary (fleet.managed.canary): {"outcome": pending | passed | failed | skipped | not needed,
    # "reason", and once run: "reference", "greedy", "mismatches", "requests", "seconds", "first_mismatch"}.
    canary = models.JSONField(default=dict, blank=True)
    instance = models.ForeignKey(ServerInstance, null=True, blank=True, on_delete=models.SET_NULL)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_s = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
