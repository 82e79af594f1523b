"""Fleet: the model servers ACE fronts, and what probing found about them."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from fleet import crypto


class ServerKind(models.TextChoices):
    VLLM = "vllm", "vLLM"
    SGLANG = "sglang", "SGLang"
    OPENAI = "openai", "OpenAI-compatible"


class EndpointStatus(models.TextChoices):
    NEW = "new", "New"
    PROBING = "probing", "Probing"
    READY = "ready", "Ready"
    DEGRADED = "degraded", "Degraded"
    UNREACHABLE = "unreachable", "Unreachable"
    UNAUTHORIZED = "unauthorized", "Unauthorized"
    ERROR = "error", "Error"


class Endpoint(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    base_url = models.URLField(max_length=500)
    kind = models.CharField(max_length=16, choices=ServerKind.choices, default=ServerKind.VLLM)
    api_key_encrypted = models.TextField(blank=True, default="")
    node_class = models.SlugField(max_length=64, default="cpu")
    status = models.CharField(max_length=16, choices=EndpointStatus.choices, default=EndpointStatus.NEW)
    status_reason = models.TextField(blank=True, default="")
    capabilities = models.JSONField(default=dict, blank=True)
    served_model = models.CharField(max_length=255, blank=True, default="")
    last_probed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    # Who may operate it (fleet.permissions): its owner, members of its team, and admins.
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="owned_endpoints"
    )
    team = models.ForeignKey(
        "auth.Group", null=True, blank=True, on_delete=models.SET_NULL, related_name="team_endpoints"
    )

    class Meta:
        ordering = ["name"]
        permissions = [
            ("operate_endpoint", "Can change modes, policies, drafts and probes of own or team endpoints"),
            ("manage_all_endpoints", "Can see and change every endpoint, whoever owns it"),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def api_key(self) -> str:
        return crypto.decrypt(self.api_key_encrypted)

    @api_key.setter
    def api_key(self, value: str) -> None:
        self.api_key_encrypted = crypto.encrypt(value or "")

    @property
    def api_key_masked(self) -> str:
        return crypto.mask(self.api_key) if self.api_key_encrypted else ""

    @property
    def has_api_key(self) -> bool:
        return bool(self.api_key_encrypted)


class GatewayTokenScope(models.Model):
    """Which endpoints an API token may call through the gateway: all its user's visible ones, or a listed set.

    A token without a scope row calls every endpoint its user can see (fleet.permissions.visible_endpoints).
    """

    token = models.OneToOneField("authtoken.Token", on_delete=models.CASCADE, related_name="ace_scope")
    all_visible = models.BooleanField(default=True)
    endpoints = models.ManyToManyField(Endpoint, blank=True, related_name="token_scopes")

    def __str__(self) -> str:
        return f"scope of {self.token.user}'s token"


class ProbeStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"


class Probe(models.Model):
    """One probing run of an endpoint. `outcome` is the endpoint status it led to."""

    endpoint = models.ForeignKey(Endpoint, related_name="probes", on_delete=models.CASCADE)
    status = models.CharField(max_length=16, choices=ProbeStatus.choices, default=ProbeStatus.QUEUED)
    outcome = models.CharField(max_length=16, choices=EndpointStatus.choices, blank=True, default="")
    reason = models.TextField(blank=True, default="")
    capabilities = models.JSONField(default=dict, blank=True)
    errors = models.JSONField(default=list, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["endpoint", "-created_at"])]

    def __str__(self) -> str:
        return f"probe {self.pk} of {self.endpoint_id}: {self.status} {self.outcome}"
