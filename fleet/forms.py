"""Fleet forms: shapes and widgets only. The rules (URL policy, unique names) live in fleet.services."""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib.auth.models import Group
from django.core.exceptions import ValidationError

from fleet import permissions, selectors
from fleet.models import Endpoint, ServerKind


class EndpointForm(forms.Form):
    name = forms.CharField(
        max_length=64,
        help_text="A short id: lowercase letters, digits, '-' or '_'.",
        widget=forms.TextInput(attrs={"autocomplete": "off", "placeholder": "llama-8b-a100"}),
    )
    base_url = forms.CharField(
        label="Base URL",
        max_length=500,
        help_text="Where the server answers, e.g. http://10.0.0.5:8000 (loopback and private networks by default).",
        widget=forms.TextInput(attrs={"placeholder": "http://127.0.0.1:8000", "autocomplete": "off"}),
    )
    kind = forms.ChoiceField(label="Server kind", choices=ServerKind.choices, initial=ServerKind.VLLM)
    node_class = forms.CharField(
        max_length=64,
        help_text="The GPU node class whose worker pool serves it (queue gpu.<node class>).",
    )
    api_key = forms.CharField(
        label="API key",
        required=False,
        max_length=4096,
        strip=True,
        # Never rendered back: the key is write-only.
        widget=forms.PasswordInput(render_value=False, attrs={"autocomplete": "new-password"}),
        help_text="Optional. Stored encrypted and never shown again.",
    )

    def __init__(self, *args, endpoint: Endpoint | None = None, user=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.endpoint = endpoint
        teams = permissions.teams_for(user)
        if endpoint is not None and endpoint.team_id is not None:
            teams = (teams | Group.objects.filter(pk=endpoint.team_id)).distinct()
        # Offered only to users with a team to give, and on an existing endpoint to its owner or an admin.
        if teams.exists() and (endpoint is None or permissions.may_change_team(user, endpoint)):
            self.fields["team"] = forms.ModelChoiceField(
                queryset=teams,
                required=False,
                empty_label="— no team (only you and admins) —",
                initial=endpoint.team_id if endpoint is not None else None,
                help_text="Members of this team may operate the endpoint too.",
            )
        self.fields["node_class"].initial = settings.DEFAULT_NODE_CLASS
        if endpoint is not None and endpoint.has_api_key:
            masked = selectors.masked_api_key(endpoint=endpoint)
            self.fields["api_key"].help_text = f"A key is set ({masked}). Leave blank to keep it, or type a new one."
            self.fields["clear_api_key"] = forms.BooleanField(label="Remove the stored API key", required=False)

    def apply_service_errors(self, exc: ValidationError) -> None:
        """Show a service's ValidationError on the fields it names (others on the whole form)."""
        if hasattr(exc, "error_dict"):
            for field, errors in exc.message_dict.items():
                self.add_error(field if field in self.fields else None, errors)
        else:
            self.add_error(None, exc.messages)
