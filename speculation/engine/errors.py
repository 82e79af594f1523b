"""Bad input is refused with one of these (all ``ValueError``s), never answered silently wrong."""

from __future__ import annotations


class SpecDecodeError(ValueError):
    """Base class of every input error the engine raises."""


class EmptyPromptError(SpecDecodeError):
    """The prompt has no tokens."""


class LookaheadError(SpecDecodeError):
    """The lookahead K is outside the supported range."""


class SamplingParamError(SpecDecodeError):
    """temperature, top_k or top_p is outside its valid range."""


class VocabMismatchError(SpecDecodeError):
    """The draft and the target do not share one vocabulary."""


class ContextLengthError(SpecDecodeError):
    """The prompt does not fit in the target's context."""


class ModelFormatError(SpecDecodeError):
    """A model directory is not a Hugging Face checkpoint of a family this engine runs (engine/families.py)."""
