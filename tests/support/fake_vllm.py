"""A stand-in for a loaded vLLM instance, for blue/green switch tests: `python -m tests.support.fake_vllm PORT
[TOKEN_DELAY_S FIRST_STEP_S METRICS_DELAY_S]`.

It keeps the three behaviours a drain depends on: completions stream one event per TOKEN_DELAY_S and end with
[DONE] (a stream cut by the process ending ends without it); `/metrics` counts a request in
`vllm:num_requests_running` only from its first engine step, FIRST_STEP_S after it was accepted (vLLM updates its
gauges from each step's scheduler stats); and `/metrics` answers after METRICS_DELAY_S, as a server whose cores are
busy. GET /v1/models lists the model. Raw asyncio, HTTP/1.1 keep-alive.
"""

from __future__ import annotations

import asyncio
import json
import sys

from speculation.bench.fake_upstream import read_request

MODEL = "fake-vllm"


class Server:
    def __init__(self, token_delay_s: float, first_step_s: float, metrics_delay_s: float) -> None:
        self.token_delay_s, self.first_step_s, self.metrics_delay_s = token_delay_s, first_step_s, metrics_delay_s
        self.running = 0  # as the gauge says: requests past their first step, not yet finished

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                method, path, body = await read_request(reader)
                if method == "GET" and path == "/v1/models":
                    models = {"object": "list", "data": [{"id": MODEL, "object": "model", "max_model_len": 1024}]}
                    writer.write(_reply(json.dumps(models).encode()))
                elif method == "GET" and path == "/metrics":
                    await asyncio.sleep(self.metrics_delay_s)
                    writer.write(_reply(self.metrics(), "text/plain"))
                elif method == "POST" and path == "/v1/completions":
                    await self.complete(writer, json.loads(body or b"{}"))
                else:
                    writer.write(_reply(b'{"error": "not found"}', status="404 Not Found"))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def metrics(self) -> bytes:
        return (
            f'vllm:num_requests_running{{engine="0"}} {float(self.running)}\n'
            'vllm:num_requests_waiting{engine="0"} 0.0\n'
        ).encode()

    async def complete(self, writer: asyncio.StreamWriter, body: dict) -> None:
        stream = bool(body.get("stream"))
        if stream:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            await writer.drain()
        await asyncio.sleep(self.first_step_s)
        self.running += 1
        try:
            tokens = max(1, min(int(body.get("max_tokens") or 16), 1000))
            for _ in range(tokens):
                await asyncio.sleep(self.token_delay_s)
                if stream:
                    _chunk(
                        writer, {"object": "text_completion", "model": MODEL, "choices": [{"index": 0, "text": " x"}]}
                    )
                    await writer.drain()
            usage = {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}
            choice = {"index": 0, "text": " x" * tokens, "finish_reason": "length"}
            if stream:
                _chunk(writer, {"object": "text_completion", "model": MODEL, "choices": [], "usage": usage})
                writer.write(_frame(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            else:
                reply = {"object": "text_completion", "model": MODEL, "choices": [choice], "usage": usage}
                writer.write(_reply(json.dumps(reply).encode()))
        finally:
            self.running -= 1


def _reply(body: bytes, content_type: str = "application/json", status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: {content_type}\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _frame(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _chunk(writer: asyncio.StreamWriter, event: dict) -> None:
    writer.write(_frame(f"data: {json.dumps(event)}\n\n".encode()))


async def serve(port: int, *delays: float) -> None:
    server = Server(*(delays or (0.05, 0.3, 0.0)))
    listener = await asyncio.start_server(server.handle, "127.0.0.1", port)
    async with listener:
        await listener.serve_forever()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), *(float(a) for a in sys.argv[2:5])))
