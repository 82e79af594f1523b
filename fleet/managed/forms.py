"""The managed endpoint form: shapes only; the rules live in fleet.managed.services."""

from __future__ import annotations

import json

from django import forms
from django.conf import settings
from django.core.exceptions import ValidationError

from fleet.managed.args import DTYPES
from fleet.managed.models import ManagedKind


class ManagedEndpointForm(forms.Form):
    name = forms.CharField(max_length=64, help_text="A short id: lowercase letters, digits, '-' or '_'.")
    kind = forms.ChoiceField(label="Server kind", choices=ManagedKind.choices, initial=ManagedKind.VLLM)
    model_dir = forms.CharField(
        label="Model directory",
        max_length=1000,
        help_text="The model's directory on the node, under the model roots (ACE_MODEL_ROOTS).",
    )
    served_name = forms.CharField(
        max_length=255, required=False, help_text="The model id clients send (default: the name)."
    )
    node_class = forms.CharField(max_length=64, help_text="The node class whose worker runs the server.")
    dtype = forms.ChoiceField(choices=[(d, d) for d in DTYPES], initial="auto")
    max_model_len = forms.IntegerField(label="Max model length", required=False, min_value=16)
    tensor_parallel_size = forms.IntegerField(label="Tensor parallel size", required=False, min_value=1)
    gpu_memory_utilization = forms.FloatField(label="GPU memory share", required=False, help_text="0.05-0.99")
    enforce_eager = forms.BooleanField(label="Enforce eager (no CUDA graphs)", required=False)

    ARG_FIELDS = ("dtype", "max_model_len", "tensor_parallel_size", "gpu_memory_utilization", "enforce_eager")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["node_class"].initial = settings.DEFAULT_NODE_CLASS

    def service_kwargs(self) -> dict:
        data = dict(self.cleaned_data)
        server_args = {name: data.pop(name) for name in self.ARG_FIELDS}
        server_args = {k: v for k, v in server_args.items() if v not in (None, "", False)}
        return {**data, "server_args": server_args}

    def apply_service_errors(self, exc: ValidationError) -> None:
        if hasattr(exc, "error_dict"):
            for field, errors in exc.message_dict.items():
                if field == "server_args":
                    errors = [json.dumps(e)[1:-1] if not isinstance(e, str) else e for e in errors]
                self.add_error(field if field in self.fields else None, errors)
        else:
            self.add_error(None, exc.messages)
