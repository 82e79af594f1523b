"""The kinds speculation's records and policies are written in (draft mechanisms, modes, verification paths), apart
from the models, so that code outside Django's app registry (the engine benchmarks, the drafting facts) can read
them."""

from __future__ import annotations

from django.db import models


class DraftKind(models.TextChoices):
    DRAFT_MODEL = "draft_model", "Draft model"
    EAGLE_HEAD = "eagle_head", "EAGLE head"
    NGRAM = "ngram", "N-gram prompt lookup"
    SUFFIX = "suffix", "Suffix decoding (earlier responses)"
    SUFFIX_DRAFT = "suffix_draft", "Suffix decoding, a draft model where it finds little"


# Kinds that draft by looking tokens up (no weights, no tokenizer of their own): a policy names no draft for them,
# and their candidate's name is the kind itself.
LOOKUP_KINDS = frozenset({DraftKind.NGRAM, DraftKind.SUFFIX})
# What a draft can be registered as (the hybrid is a policy's mechanism over a registered draft model).
REGISTRABLE_KINDS = [(value, label) for value, label in DraftKind.choices if value != DraftKind.SUFFIX_DRAFT]
HYBRID_PREFIX = "suffix+"  # a hybrid candidate's name: this prefix and its draft model's name


class Mode(models.TextChoices):
    OFF = "off", "Off"
    SHADOW = "shadow", "Shadow"
    PROD = "prod", "Prod"


# A policy's mechanism is the kind of draft it speculates with: one enum, two names that read well where used.
Mechanism = DraftKind


class VerificationPath(models.TextChoices):
    AUTO = "auto", "Auto (from the probe)"
    NATIVE = "native", "Native (the server speculates)"
    REMOTE = "remote", "Remote (target scores drafts)"
    LOCAL = "local", "Local (target in the worker)"
