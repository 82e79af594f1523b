"""The /tokenize and /detokenize routes vLLM and SGLang both serve (they differ only in the detokenized key)."""

from __future__ import annotations

from typing import Any, ClassVar

from fleet.adapters.base import (
    CANARY_TEXT,
    FailureKind,
    ProbeError,
    ServerClient,
    expect_dict,
    expect_token_ids,
    fingerprint,
    shape_error,
)


class TokenizerRoutes:
    """Mixin for adapters whose server tokenizes: canary token ids, fingerprint, detokenize round trip."""

    detokenized_key: ClassVar[str]  # where POST /detokenize puts the text

    def discover_tokenizer(self, client: ServerClient, caps: dict[str, Any]) -> dict[str, Any]:
        body = expect_dict(
            client.post_json(
                "/tokenize", {"model": caps["served_model"], "prompt": CANARY_TEXT, "add_special_tokens": True}
            ),
            "/tokenize",
        )
        ids = expect_token_ids(body.get("tokens"), "/tokenize tokens")
        caps["tokenize"] = True
        caps["canary_token_ids"] = ids
        caps["tokenizer_fingerprint"] = fingerprint(ids)
        return body

    def discover_detokenize(self, client: ServerClient, caps: dict[str, Any]) -> None:
        ids = caps.get("canary_token_ids")
        if not ids:
            raise ProbeError(FailureKind.UNSUPPORTED, "skipped: no token ids to detokenize (tokenize failed)")
        body = expect_dict(
            client.post_json("/detokenize", {"model": caps["served_model"], "tokens": ids}), "/detokenize"
        )
        text = body.get(self.detokenized_key)
        if not isinstance(text, str):
            raise shape_error(f"/detokenize has no {self.detokenized_key} string")
        caps["detokenize"] = True
        caps["detokenize_roundtrip"] = CANARY_TEXT in text
