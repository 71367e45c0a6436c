"""Relaying one request to the replicas: routing, fail-over, streaming, usage and broadcasts.

Fail-over contract: a request is retried on the next replica when the chosen one fails at the
transport level (refused connection, reset, timeout) *before any byte went to the client*, which
for a non-streamed request includes a replica dying mid-request. Once a streamed response has
started, a failure truncates it (the client sees the broken stream) and is counted as failed.
A replica that refuses a connection is marked down at once; the app's health loop
(:meth:`Proxy.check_health` every ``health_interval_s``) brings it back.

:class:`Proxy` knows the :class:`~prefixcache.router.policies.Router` (which replica, and what
happened there) and one shared httpx client; it knows nothing of the app or of keep-warm, which
gets :meth:`Proxy.send_to_healthy` as a plain callable.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.router.affinity import PrefixKey, prefix_key, render_prompt
from prefixcache.router.config import RouterConfig
from prefixcache.router.policies import Replica, Router

log = logging.getLogger(__name__)

# Hop-by-hop and length headers: recomputed by the server on each side.
_DROP_REQUEST = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "accept-encoding",
    "upgrade",
}
_DROP_RESPONSE = {
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-encoding",
    "x-prefixcache-blocks",  # the replica's answer to the router alone
}
#: The router asks a replica for the prompt's block hashes, which it answers in BLOCKS.
WANT_BLOCKS = "x-prefixcache-want-blocks"
BLOCKS = "x-prefixcache-blocks"


@dataclass(frozen=True, slots=True)
class ReplicaReply:
    """What one replica answered to a request sent to it alone (no fail-over)."""

    url: str
    status: int  # the HTTP status, 0 when the replica could not be reached
    body: Any  # the JSON body, else the first 500 characters of the text, else the transport error

    def as_dict(self) -> dict[str, Any]:
        return {"url": self.url, "status": self.status, "body": self.body}


def usage_from(obj: Any) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) from an OpenAI chat/completions, OpenAI Responses or
    Anthropic response, or from one of their stream events."""
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    for wrapper in ("message", "response"):  # Anthropic message_start; Responses stream events
        if not isinstance(usage, dict) and isinstance(obj.get(wrapper), dict):
            usage = obj[wrapper].get("usage")
    if not isinstance(usage, dict):
        return None
    if isinstance(usage.get("prompt_tokens"), int):
        details = usage.get("prompt_tokens_details") or {}
        return usage["prompt_tokens"], int(details.get("cached_tokens") or 0)
    if not isinstance(usage.get("input_tokens"), int):
        return None
    details = usage.get("input_tokens_details")
    if isinstance(details, dict):  # Responses: input_tokens is the whole prompt
        return usage["input_tokens"], int(details.get("cached_tokens") or 0)
    read = int(usage.get("cache_read_input_tokens") or 0)  # Anthropic: input_tokens is the rest
    created = int(usage.get("cache_creation_input_tokens") or 0)
    return usage["input_tokens"] + read + created, read


class SSEUsage:
    """Finds the usage in a server-sent-event stream fed in arbitrary byte chunks."""

    def __init__(self) -> None:
        self._buf = b""
        self.usage: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> None:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:") and b"usage" in line:
                try:
                    found = usage_from(json.loads(line[5:]))
                except ValueError:
                    continue
                if found is not None and (self.usage is None or found[0] >= self.usage[0]):
                    self.usage = found  # Anthropic repeats usage in message_delta; keep the fullest


def _error(status: int, message: str, anthropic: bool) -> JSONResponse:
    if anthropic:
        body: dict[str, Any] = {"type": "error", "error": {"type": "api_error", "message": message}}
    else:
        body = {"error": {"message": message, "type": "server_error", "code": "no_replica"}}
    return JSONResponse(body, status_code=status)


def rendered_chars(body: dict[str, Any]) -> int:
    """Length of the whole routing rendering of ``body`` (the chunks cover its start)."""
    return len(render_prompt(body, 1 << 62))


class Proxy:
    """Routes and relays one request at a time; shares one httpx client."""

    def __init__(self, router: Router, config: RouterConfig, client: httpx.AsyncClient) -> None:
        self.router = router
        self.config = config
        self.client = client

    def key_of(self, body: dict[str, Any], headers: Any) -> PrefixKey:
        credential = headers.get("authorization") or headers.get("x-api-key") or ""
        return prefix_key(
            body, credential, chunk_chars=self.config.chunk_chars, affinity_chars=self.config.affinity_chars
        )

    async def handle(self, request: Request) -> Response:
        """Route ``request`` and relay the answer (the fail-over contract is the module's); 503
        in the client's API shape when no replica could take it."""
        raw = await request.body()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        key = self.key_of(body, request.headers)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        headers["accept-encoding"] = "identity"
        kv_index = self.router.kv_index
        if kv_index is not None:  # ask for the prompt's block hashes (router/kv_index.py)
            headers[WANT_BLOCKS] = "1"
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        anthropic = request.url.path.startswith("/v1/messages")
        errors: list[str] = []
        for replica in self.router.candidates(key):
            self.router.started(replica, key)
            upstream = self.client.build_request(
                request.method, replica.url + target, content=raw, headers=headers
            )
            try:
                resp = await self.client.send(upstream, stream=True)
            except httpx.TransportError as exc:
                self._down(replica, key, exc, errors)
                continue
            blocks = resp.headers.get(BLOCKS)
            if kv_index is not None and blocks and resp.status_code == 200:
                kv_index.learn(key.chunks, rendered_chars(body), blocks)
            if "text/event-stream" in resp.headers.get("content-type", ""):
                return StreamingResponse(
                    self._relay(resp, replica),
                    status_code=resp.status_code,
                    headers=self._response_headers(resp, replica),
                )
            try:
                content = await resp.aread()
            except httpx.TransportError as exc:  # died mid-response; nothing sent yet: retry
                await resp.aclose()
                self._down(replica, key, exc, errors)
                continue
            await resp.aclose()
            self.router.finished(replica, ok=resp.status_code < 500, error=f"HTTP {resp.status_code}")
            if resp.status_code == 200:
                with contextlib.suppress(ValueError):
                    u = usage_from(json.loads(content))
                    if u is not None:
                        self.router.usage(replica, *u)
            return Response(
                content, status_code=resp.status_code, headers=self._response_headers(resp, replica)
            )
        detail = "; ".join(errors[-3:]) or "no replica configured"
        return _error(
            503, f"No replica could take the request ({detail}). Check the replicas' /health.", anthropic
        )

    def _down(self, replica: Replica, key: PrefixKey, exc: Exception, errors: list[str]) -> None:
        msg = f"{replica.url}: {type(exc).__name__}: {exc}"
        log.warning("router: %s; failing over", msg)
        errors.append(msg)
        self.router.connect_failed(replica, key, msg)

    @staticmethod
    def _response_headers(resp: httpx.Response, replica: Replica) -> dict[str, str]:
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE}
        headers["x-prefixcache-replica"] = replica.url
        return headers

    async def _relay(self, resp: httpx.Response, replica: Replica) -> AsyncIterator[bytes]:
        sniff = SSEUsage()
        ok, error = False, ""
        try:
            async for chunk in resp.aiter_raw():
                sniff.feed(chunk)
                yield chunk
            ok = resp.status_code < 500
            error = f"HTTP {resp.status_code}"
        except httpx.TransportError as exc:  # bytes already went out: no retry, the stream breaks
            error = f"stream broken: {type(exc).__name__}: {exc}"
            log.warning("router: %s from %s", error, replica.url)
        finally:
            await resp.aclose()
            self.router.finished(replica, ok=ok, error=error)
            if sniff.usage is not None:
                self.router.usage(replica, *sniff.usage)

    async def broadcast(self, request: Request) -> Response:
        """Send the request to every healthy replica; 200 if any accepted it (keep-warm pins)."""
        raw = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        replies = await self.send_to_healthy(request.method, request.url.path, raw, headers)
        ok = any(200 <= reply.status < 300 for reply in replies)
        return JSONResponse(
            {"replicas": [reply.as_dict() for reply in replies]},
            status_code=200 if ok else 502,
        )

    async def send_to_healthy(
        self, method: str, path: str, raw: bytes, headers: dict[str, str]
    ) -> list[ReplicaReply]:
        """The same request to every replica healthy now, concurrently, no fail-over: one reply
        each, in replica order. Touches no routing counters (these are not routed requests)."""
        healthy = [r for r in self.router.replicas if r.healthy]
        return await asyncio.gather(*(self.send_one(method, r, path, raw, headers) for r in healthy))

    async def send_one(
        self, method: str, replica: Replica, path: str, raw: bytes, headers: dict[str, str]
    ) -> ReplicaReply:
        """One request to one replica, no fail-over."""
        try:
            resp = await self.client.request(method, replica.url + path, content=raw, headers=headers)
        except httpx.TransportError as exc:
            return ReplicaReply(replica.url, 0, f"{type(exc).__name__}: {exc}")
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text[:500]
        return ReplicaReply(replica.url, resp.status_code, body)

    async def check_health(self) -> None:
        """One round of GET /health on every replica; marks each up or down."""

        async def one(r: Replica) -> None:
            try:
                resp = await self.client.get(r.url + "/health", timeout=self.config.health_timeout_s)
                self.router.set_health(r, resp.status_code == 200, f"health: HTTP {resp.status_code}")
            except httpx.HTTPError as exc:
                self.router.set_health(r, False, f"health: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(one(r) for r in self.router.replicas))
