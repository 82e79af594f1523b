"""What a server kind means by the length fields of an OpenAI request, so prod generates what off would.

Each adapter class carries one `RequestSemantics` (`semantics` class attribute); the gateway reads it with
`fleet.adapters.semantics_for(kind)` and never asks which server it talks to.

vLLM 0.32 (`entrypoints/openai/*/protocol.py`, `serve/utils/api_utils.py: get_max_tokens`):
- /v1/completions reads only `max_tokens` (null or absent: 16); `max_completion_tokens` is ignored;
- /v1/chat/completions reads `max_completion_tokens`, else `max_tokens`, else what the context leaves;
- both are cut to what the context leaves (max_model_len - prompt tokens); a budget above max_model_len
  itself is refused with 400 (`renderers/params.py`).
The OpenAI API and SGLang define the same defaults (completions 16, chat up to the context).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestSemantics:
    completion_length_fields: tuple[str, ...] = ("max_tokens",)
    chat_length_fields: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    completion_default_max_tokens: int | None = 16  # None: what the context leaves
    chat_default_max_tokens: int | None = None

    def max_new_tokens(self, *, kind: str, body: dict[str, Any], prompt_len: int, max_context: int) -> int:
        """The output token budget the server applies to this request (kind "chat" or "completion"); it may be
        < 1 when the prompt fills the context. ValueError when the server refuses the budget itself."""
        chat = kind == "chat"
        fields = self.chat_length_fields if chat else self.completion_length_fields
        asked = next((body[name] for name in fields if body.get(name) is not None), None)
        if asked is None:
            asked = self.chat_default_max_tokens if chat else self.completion_default_max_tokens
        elif int(asked) > max_context:
            raise ValueError(f"{asked} output tokens > the context of {max_context} (the server refuses it)")
        room = max_context - prompt_len
        return room if asked is None else min(int(asked), room)


VLLM = RequestSemantics()
OPENAI = RequestSemantics()
SGLANG = RequestSemantics()
