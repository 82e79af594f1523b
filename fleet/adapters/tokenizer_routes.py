"""Probing the /tokenize and /detokenize routes vLLM and SGLang both serve (their wire format says the shapes)."""

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
    shape_checked,
)
from fleet.adapters.wire import ServerWire


class TokenizerRoutes:
    """Mixin for adapters whose server tokenizes: canary token ids, fingerprint, detokenize round trip."""

    wire: ClassVar[ServerWire]

    def discover_tokenizer(self, client: ServerClient, caps: dict[str, Any]) -> dict[str, Any]:
        request = self.wire.tokenize(model=caps["served_model"], prompt=CANARY_TEXT, add_special_tokens=True)
        body = expect_dict(client.send(request), "/tokenize")
        ids = expect_token_ids(body.get("tokens"), "/tokenize tokens")
        caps["tokenize"] = True
        caps["canary_token_ids"] = ids
        caps["tokenizer_fingerprint"] = fingerprint(ids)
        return body

    def discover_detokenize(self, client: ServerClient, caps: dict[str, Any]) -> None:
        ids = caps.get("canary_token_ids")
        if not ids:
            raise ProbeError(FailureKind.UNSUPPORTED, "skipped: no token ids to detokenize (tokenize failed)")
        body = client.send(self.wire.detokenize(model=caps["served_model"], token_ids=ids))
        with shape_checked():
            text = self.wire.parse_detokenize(body)
        caps["detokenize"] = True
        caps["detokenize_roundtrip"] = CANARY_TEXT in text
