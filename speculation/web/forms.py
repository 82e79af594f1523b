"""Dashboard forms: policy settings, draft registration, stage record filters. Validation of substance
lives in the services (speculation.services.*); these only parse input."""

from __future__ import annotations

from django import forms

from ace.query_params import is_ascii_digits
from fleet import permissions
from speculation.limits import K_MAX, K_MIN
from speculation.models import REGISTRABLE_KINDS, Action, Mechanism, Mode, VerificationPath
from speculation.selectors.rollups import RANGES


class PolicyForm(forms.Form):
    mode = forms.ChoiceField(choices=Mode.choices, widget=forms.RadioSelect)
    mechanism = forms.ChoiceField(choices=Mechanism.choices)
    draft = forms.ChoiceField(required=False, help_text="A registered draft sharing the endpoint's tokenizer.")
    k = forms.IntegerField(label="Lookahead K", min_value=K_MIN, max_value=K_MAX)
    dynamic_k = forms.BooleanField(label="Dynamic K (adapt to acceptance and load)", required=False)
    eagle_tree = forms.CharField(
        label="EAGLE draft tree",
        required=False,
        max_length=64,
        help_text="EAGLE heads only: top_k,depth,nodes[,score temperature] (e.g. 4,6,24), an EAGLE-2 tree "
        "verified in one target pass (K caps its depth); empty drafts a chain of K.",
    )
    auto_pairing = forms.BooleanField(
        label="Draft: auto (apply auto-pairing's winner and its K)",
        required=False,
        help_text="ACE switches the draft and K itself when shadow's replays show a clearly better pairing.",
    )
    shadow_sample_rate = forms.FloatField(
        min_value=0.0, max_value=1.0, help_text="Fraction of shadow traffic that is measured (0-1)."
    )
    path = forms.ChoiceField(label="Verification path", choices=VerificationPath.choices)
    target_path = forms.CharField(
        required=False, max_length=1000, help_text="Path local only: the target's model directory on the node."
    )

    def __init__(self, *args, draft_names: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fields["draft"].choices = [("", "— none —")] + [(name, name) for name in draft_names]

    def clean_eagle_tree(self) -> dict:
        """Text "top_k,depth,nodes[,score_temperature]" -> eagle_tree ({} when empty); the service checks ranges."""
        text = self.cleaned_data["eagle_tree"].strip()
        if not text:
            return {}
        parts = [part.strip() for part in text.split(",")]
        if len(parts) not in (3, 4) or not all(is_ascii_digits(part) for part in parts[:3]):
            raise forms.ValidationError("write top_k,depth,nodes as three whole numbers (e.g. 4,6,24), or leave empty")
        tree: dict = dict(zip(("top_k", "depth", "nodes"), map(int, parts[:3]), strict=True))
        if len(parts) == 4:
            try:
                tree["score_temperature"] = float(parts[3])
            except ValueError as exc:
                raise forms.ValidationError(f"the score temperature is not a number: {parts[3]!r}") from exc
        return tree

    def apply_service_errors(self, exc) -> None:
        """Put a service ValidationError ({field: [messages]}) on the matching fields."""
        errors = exc.message_dict if hasattr(exc, "error_dict") else {None: exc.messages}
        for field, messages in errors.items():
            for message in messages:
                self.add_error(field if field in self.fields else None, message)


def tree_text(tree: dict | None) -> str:
    """A policy's eagle_tree as the form writes it ("4,6,24"; "" for a chain)."""
    if not tree:
        return ""
    names = ["top_k", "depth", "nodes"] + (["score_temperature"] if "score_temperature" in tree else [])
    return ",".join(f"{tree.get(name, '')}" for name in names)


class ModeForm(forms.Form):
    mode = forms.ChoiceField(choices=Mode.choices)


class DraftRegisterForm(forms.Form):
    name = forms.SlugField(max_length=64)
    kind = forms.ChoiceField(choices=REGISTRABLE_KINDS)
    path = forms.CharField(
        required=False, max_length=1000, help_text="Local Hugging Face model directory (empty for n-gram)."
    )
    node_class = forms.SlugField(max_length=64, initial="cpu")
    target_name = forms.CharField(
        required=False, max_length=255, help_text="EAGLE heads: the target it was trained for."
    )

    def __init__(self, *args, user=None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        teams = permissions.teams_for(user)
        if teams.exists():  # offered only to users with a team to give
            self.fields["team"] = forms.ModelChoiceField(
                queryset=teams,
                required=False,
                empty_label="— no team (only you and admins) —",
                help_text="Members of this team may see and use the draft too.",
            )

    apply_service_errors = PolicyForm.apply_service_errors


class RecordFilterForm(forms.Form):
    action = forms.ChoiceField(choices=[("", "any action")] + list(Action.choices), required=False)
    mode = forms.ChoiceField(choices=[("", "any mode")] + list(Mode.choices), required=False)
    range = forms.ChoiceField(choices=[(name, f"last {name}") for name in RANGES], required=False)
