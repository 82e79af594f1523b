"""A model server that answers at once: `python -m speculation.bench.fake_upstream PORT`.

For measuring the gateway's own overhead without a model's noise: every POST to /v1/completions or
/v1/chat/completions gets the same small OpenAI-shaped JSON body (keep-alive, HTTP/1.1), a streamed completion
(`"stream": true`) max_tokens events and a usage event (speculation.bench.plain_path), GET /v1/models lists one
model. Raw asyncio, no framework, so its own cost stays far below the gateway's.
"""

from __future__ import annotations

import asyncio
import json
import sys

MODEL = "fake-target"
COMPLETION = json.dumps(
    {
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": " pass", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
    }
).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 2048}]}).encode()


def _reply(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    """One HTTP/1.1 request off a kept-alive connection: (method, path, body)."""
    head = await reader.readuntil(b"\r\n\r\n")
    request_line, *lines = head.decode("latin1").split("\r\n")
    length = 0
    for line in lines:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    method, path = request_line.split(" ")[:2]
    return method, path, body


async def _serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            method, path, body = await read_request(reader)
            if method == "GET" and path == "/v1/models":
                writer.write(_reply(MODELS))
            elif method == "POST" and path == "/v1/completions" and b'"stream":true' in body.replace(b" ", b""):
                await _stream(writer, _max_tokens(body))
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                writer.write(_reply(COMPLETION))
            else:
                writer.write(_reply(b'{"error": "not found"}', "404 Not Found"))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _max_tokens(body: bytes) -> int:
    try:
        return max(1, int(json.loads(body).get("max_tokens") or 16))
    except (ValueError, TypeError, AttributeError):
        return 16


async def _stream(writer: asyncio.StreamWriter, tokens: int) -> None:
    """A completion stream as vLLM sends it: one event per token, each its own HTTP chunk and write, then a usage
    event and [DONE]."""
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    events = [
        {"id": "cmpl-fake", "object": "text_completion", "model": MODEL, "choices": [{"index": 0, "text": " x"}]}
    ] * tokens
    usage = {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}
    events = [*events, {"id": "cmpl-fake", "object": "text_completion", "model": MODEL, "choices": [], "usage": usage}]
    for event in [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]:
        writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
        await writer.drain()
    writer.write(b"0\r\n\r\n")


async def serve(port: int) -> None:
    server = await asyncio.start_server(_serve, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1])))
