"""A stand-in replica for router tests: OpenAI/Anthropic shapes, a toy prefix cache, no model.

Run: ``python fake_replica.py PORT NAME [DELAY_S] [MODE]``. It answers /health, /v1/chat/completions
(streamed or not), /v1/messages, /v1/cache/pin and /stats (what it served). Its "cache" counts a
prompt's characters in 64-char blocks already seen by this replica, so a router that keeps a
prefix on one replica shows hits and one that scatters it does not.

``MODE`` makes streamed chat answers hang, so that a test can kill the process at a known point:
``hold-before-body`` sends the headers and no event; ``hold-mid-stream`` sends the first event
and nothing more. A request is in ``/stats`` before its answer starts.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

BLOCK = 64


def make_app(name: str, delay_s: float = 0.0, mode: str = "") -> FastAPI:
    app = FastAPI()
    seen: set[str] = set()
    served: list[dict[str, Any]] = []
    pins: list[dict[str, Any]] = []

    def account(body: dict[str, Any], auth: str) -> tuple[int, int]:
        text = auth + json.dumps(body.get("system")) + json.dumps(body.get("messages"))
        cached = 0
        for end in range(BLOCK, len(text) + 1, BLOCK):
            if text[:end] in seen:
                cached = end
            else:
                seen.add(text[:end])
        return len(text) // 4, cached // 4

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok", "name": name}

    @app.get("/stats")
    async def stats() -> Any:
        return {"name": name, "served": served, "pins": pins}

    @app.post("/v1/cache/pin")
    async def pin(request: Request) -> Any:
        pins.append({"body": await request.json(), "auth": request.headers.get("authorization")})
        return {"pinned_tokens": 16, "prompt_tokens": 20}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await request.json()
        prompt, cached = account(body, request.headers.get("authorization", ""))
        served.append({"user": body.get("user"), "cached": cached})
        if delay_s:
            await asyncio.sleep(delay_s)
        usage = {
            "prompt_tokens": prompt,
            "completion_tokens": 2,
            "total_tokens": prompt + 2,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        if body.get("stream"):

            async def events() -> Any:
                if mode == "hold-before-body":
                    await asyncio.Event().wait()  # until the process is killed
                for i, word in enumerate(("hello", " world")):
                    if i == 1 and mode == "hold-mid-stream":
                        await asyncio.Event().wait()
                    chunk = {
                        "object": "chat.completion.chunk",
                        "choices": [{"index": 0, "delta": {"content": word}}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n"
                    await asyncio.sleep(0)
                last = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
                yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse(
            {
                "id": "x",
                "object": "chat.completion",
                "model": body.get("model"),
                "replica": name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hello world"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
        )

    @app.post("/v1/messages")
    async def messages(request: Request) -> Any:
        body = await request.json()
        prompt, cached = account(body, request.headers.get("x-api-key", ""))
        served.append({"user": (body.get("metadata") or {}).get("user_id"), "cached": cached})
        usage = {
            "input_tokens": prompt - cached,
            "cache_read_input_tokens": cached,
            "cache_creation_input_tokens": 0,
            "output_tokens": 2,
        }
        if body.get("stream"):

            async def events() -> Any:
                start = {"type": "message_start", "message": {"id": "m", "role": "assistant", "usage": usage}}
                yield f"event: message_start\ndata: {json.dumps(start)}\n\n"
                delta = {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": "hi"},
                }
                yield f"event: content_block_delta\ndata: {json.dumps(delta)}\n\n"
                yield 'event: message_stop\ndata: {"type": "message_stop"}\n\n'

            return StreamingResponse(events(), media_type="text/event-stream")
        return {
            "id": "m",
            "type": "message",
            "role": "assistant",
            "replica": name,
            "content": [{"type": "text", "text": "hi"}],
            "usage": usage,
        }

    return app


if __name__ == "__main__":
    import uvicorn

    port, name = int(sys.argv[1]), sys.argv[2]
    delay = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    mode = sys.argv[4] if len(sys.argv) > 4 else ""
    uvicorn.run(make_app(name, delay, mode), host="127.0.0.1", port=port, log_level="warning")
