"""Responses and stream chunks in the shape vLLM gives them, for tokens ACE produced itself (prod)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from speculation.gateway.sse import event


@dataclass
class Shape:
    kind: str  # "chat" | "completion"
    request_id: str
    model: str
    prompt_ids: list[int]
    return_token_ids: bool = False
    include_usage: bool = False
    echo_text: str = ""  # completions with echo: the prompt text, before the first generated text
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    def _head(self, *, chunk: bool) -> dict[str, Any]:
        if self.kind == "chat":
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def usage(self, completion_tokens: int) -> dict[str, int]:
        prompt = len(self.prompt_ids)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion_tokens,
            "completion_tokens": completion_tokens,
        }

    # --- streaming ---------------------------------------------------------------------------------------------
    def first_chunk(self) -> bytes:
        if self.kind != "chat":
            return b""
        payload = self._head(chunk=True)
        payload["choices"] = [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        ]
        if self.return_token_ids:
            payload["prompt_token_ids"] = self.prompt_ids
        return event(payload)

    def chunk(
        self,
        text: str,
        ids: list[int],
        *,
        finish_reason: str | None = None,
        stop_reason: int | str | None = None,
        first: bool = False,
    ) -> bytes:
        if first and self.echo_text:
            text = self.echo_text + text
        payload = self._head(chunk=True)
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None or self.kind == "completion":
            choice["stop_reason"] = stop_reason
        if self.return_token_ids:
            if self.kind == "completion":
                choice["prompt_token_ids"] = self.prompt_ids if first else None
            choice["token_ids"] = ids
        payload["choices"] = [choice]
        return event(payload)

    def usage_chunk(self, completion_tokens: int) -> bytes:
        if not self.include_usage:
            return b""
        payload = self._head(chunk=True)
        payload["choices"] = []
        payload["usage"] = self.usage(completion_tokens)
        return event(payload)

    # --- whole response ----------------------------------------------------------------------------------------
    def response(
        self, text: str, ids: list[int], finish_reason: str, stop_reason: int | str | None = None
    ) -> dict[str, Any]:
        payload = self._head(chunk=False)
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        else:
            choice = {
                "index": 0,
                "text": self.echo_text + text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
            }
        if self.return_token_ids:
            choice["token_ids"] = ids
            if self.kind == "completion":
                choice["prompt_token_ids"] = self.prompt_ids
        payload["choices"] = [choice]
        # vLLM dumps the whole response with every field, so the usage details come as null
        payload["usage"] = {**self.usage(len(ids)), "prompt_tokens_details": None, "completion_tokens_details": None}
        if self.return_token_ids and self.kind == "chat":
            payload["prompt_token_ids"] = self.prompt_ids
        return payload
