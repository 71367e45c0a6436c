"""Relaying one request to the replicas: routing, fail-over, streaming, usage and broadcasts.

Fail-over contract (``MAX_ATTEMPTS`` = 2):

* A request is retried on the next replica in the policy's order **only if no byte went to the
  client, and at most once**. Nothing has gone out while the router waits for a replica's
  answer: a non-streamed answer is read whole before it is relayed, and a streamed one is
  relayed from its first body chunk on (headers wait for it), so a replica that dies during a
  long prefill is retried too.
* What is retried: a refused connection, a connect timeout, a connection reset or closed before
  the answer was complete (the replica died). The replica is marked down at once (and its
  prefixes forgotten); the app's health loop (:meth:`Proxy.check_health` every
  ``health_interval_s``) brings it back when ``GET /health`` answers 200 again.
* What is not: a **read timeout** (the replica is slow, not gone: it stays in rotation, the
  client gets a 504 and the request is not sent again, since retrying slow work doubles the
  load exactly when replicas are overloaded); an **HTTP error status** (the replica answered:
  its 4xx or 5xx is relayed as is).
* Once bytes of a stream went out, a failure is a **broken stream**: the router ends the stream
  with an error event in the API's shape after the last whole event (never a partial event,
  never another replica's continuation), counts it (``prefixcache_router_broken_streams_total``)
  and marks the replica down unless it was a read timeout.

Bodies are bounded before any of this: the app's :class:`~prefixcache.limits.BodyLimit` (413)
and :func:`~prefixcache.limits.parse_json_body` here (400 for nesting deeper than 64 levels or a
lone surrogate, which would otherwise break the routing key). Malformed JSON is forwarded: the
replica's 400 names the problem.

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

import anyio
import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from prefixcache.limits import RejectedBody, parse_json_body
from prefixcache.router.affinity import PrefixKey, prefix_key, render_prompt
from prefixcache.router.config import RouterConfig
from prefixcache.router.policies import Replica, Router
from prefixcache.router.streams import EventCutter, SSEUsage, error_body, stream_error_event, usage_from

__all__ = ["MAX_ATTEMPTS", "Proxy", "ReplicaReply", "SSEUsage", "usage_from"]

log = logging.getLogger(__name__)

#: Replicas one request may be sent to: the first choice and one retry.
MAX_ATTEMPTS = 2
#: Bodies parsed off the event loop above this size.
OFF_LOOP_BYTES = 256 << 10

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


def _reply_message(reply: ReplicaReply) -> str:
    """The message of a replica's error body, whichever API shape it has."""
    body = reply.body
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        message = body["error"].get("message")
        if isinstance(message, str) and message:
            return message
    return f"the replica answered HTTP {reply.status}"


def error_response(status: int, message: str, path: str, code: str) -> JSONResponse:
    """A router error in the shape of the API ``path`` belongs to."""
    return JSONResponse(error_body(status, message, path, code), status_code=status)


def _is_slow(exc: httpx.TransportError) -> bool:
    """A timeout after the connection was made: the replica is slow, not gone."""
    return isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout)


class _Lost(Exception):
    """An attempt failed before any byte went to the client (``exc`` says how)."""

    def __init__(self, exc: httpx.TransportError) -> None:
        super().__init__(str(exc))
        self.exc = exc


class _Relay:
    """One relayed stream: whole events out; on a transport error an error event ends it (a
    broken stream). Its bookkeeping runs exactly once (:meth:`close`), whether the stream ended,
    broke, or the client left, even before the first chunk was asked for."""

    def __init__(
        self,
        router: Router,
        replica: Replica,
        resp: httpx.Response,
        chunks: AsyncIterator[bytes],
        first: bytes | None,
        path: str,
    ) -> None:
        self.router, self.replica, self.resp, self.chunks, self.first = router, replica, resp, chunks, first
        self.path = path
        self.sniff = SSEUsage()
        self.broken: httpx.TransportError | None = None
        self.closed = False

    async def events(self) -> AsyncIterator[bytes]:
        cutter = EventCutter()
        try:
            data = self.first
            while data is not None:
                out = cutter.feed(data)
                if out:
                    self.sniff.feed(out)
                    yield out
                try:
                    data = await anext(self.chunks, None)
                except httpx.TransportError as exc:  # bytes already went out: no retry
                    self.broken = exc
                    break
            if self.broken is None:
                rest = cutter.rest()
                if rest:
                    self.sniff.feed(rest)
                    yield rest
            else:
                log.warning("router: stream broken: %s: %s", self.replica.url, self._why())
                text = (
                    "The replica serving this stream failed mid-answer; the answer is incomplete: "
                    "send the request again."
                )
                lead = b"" if cutter.at_boundary else b"\n\n"
                yield lead + stream_error_event(self.path, text, "stream_broken")
        finally:
            await self.close()

    def _why(self) -> str:
        return f"{type(self.broken).__name__}: {self.broken}"

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.resp.aclose()
        if self.broken is not None:
            down = not _is_slow(self.broken)
            self.router.stream_broken(self.replica, f"stream broken: {self._why()}", down=down)
        else:  # a clean end, or the client went away (not the replica's failure)
            status = self.resp.status_code
            self.router.finished(self.replica, ok=status < 500, error=f"HTTP {status}")
        if self.sniff.usage is not None:
            self.router.usage(self.replica, *self.sniff.usage)


class _RelayResponse(StreamingResponse):
    """Streams a :class:`_Relay` and closes it in every case (a client that leaves before the
    first chunk never starts the generator, whose own ``finally`` then never runs)."""

    def __init__(self, relay: _Relay, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(relay.events(), status_code=status_code, headers=headers)
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.relay.close()


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
        """Route ``request`` and relay the answer (the fail-over contract is the module's): 400
        for a body no replica could use, 504 when the replica was too slow, 503 in the client's
        API shape when no replica could take it."""
        path = request.url.path
        raw = await request.body()
        try:
            if len(raw) > OFF_LOOP_BYTES:
                parsed = await anyio.to_thread.run_sync(parse_json_body, raw)
            else:
                parsed = parse_json_body(raw) if raw else {}
        except RejectedBody as rejected:
            return error_response(400, str(rejected.detail), path, rejected.code or "invalid_request")
        except ValueError:  # malformed JSON: the replica's 400 says what is wrong
            parsed = {}
        body = parsed if isinstance(parsed, dict) else {}
        key = self.key_of(body, request.headers)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        headers["accept-encoding"] = "identity"
        if self.router.kv_index is not None:  # ask for the prompt's block hashes (router/kv_index.py)
            headers[WANT_BLOCKS] = "1"
        target = path + (f"?{request.url.query}" if request.url.query else "")
        errors: list[str] = []
        for attempt, replica in enumerate(self.router.candidates(key)[:MAX_ATTEMPTS]):
            if attempt:
                self.router.failed_over()
            self.router.started(replica, key)
            try:
                return await self._attempt(request.method, replica, target, raw, headers, key, body)
            except _Lost as lost:
                msg = f"{replica.url}: {type(lost.exc).__name__}: {lost.exc}"
                errors.append(msg)
                if _is_slow(lost.exc):
                    log.warning("router: %s; slow, not retried", msg)
                    self.router.timed_out(replica, msg)
                    return error_response(
                        504,
                        f"The replica did not answer within {self.config.read_timeout_s:g} s (the "
                        "router's --read-timeout); retry later or raise the timeout.",
                        path,
                        "replica_timeout",
                    )
                log.warning("router: %s; failing over", msg)
                self.router.connect_failed(replica, key, msg)
        detail = "; ".join(errors[-MAX_ATTEMPTS:]) or "no replica configured"
        return error_response(
            503,
            f"No replica could take the request ({detail}). Check the replicas' /health.",
            path,
            "no_replica",
        )

    async def _attempt(
        self,
        method: str,
        replica: Replica,
        target: str,
        raw: bytes,
        headers: dict[str, str],
        key: PrefixKey,
        body: dict[str, Any],
    ) -> Response:
        """One attempt at ``replica``; raises :class:`_Lost` while nothing went to the client."""
        upstream = self.client.build_request(method, replica.url + target, content=raw, headers=headers)
        try:
            resp = await self.client.send(upstream, stream=True)
        except httpx.TransportError as exc:
            raise _Lost(exc) from exc
        blocks = resp.headers.get(BLOCKS)
        kv_index = self.router.kv_index
        if kv_index is not None and blocks and resp.status_code == 200:
            kv_index.learn(key.chunks, rendered_chars(body), blocks)
        if "text/event-stream" in resp.headers.get("content-type", ""):
            chunks = resp.aiter_raw()
            try:  # the first chunk before any header goes out: until then, a retry is safe
                first = await anext(chunks, None)
            except httpx.TransportError as exc:
                await resp.aclose()
                raise _Lost(exc) from exc
            relay = _Relay(self.router, replica, resp, chunks, first, target.split("?", 1)[0])
            return _RelayResponse(relay, resp.status_code, self._response_headers(resp, replica))
        try:
            content = await resp.aread()
        except httpx.TransportError as exc:  # died mid-response; nothing sent yet
            raise _Lost(exc) from exc
        finally:
            await resp.aclose()
        self.router.finished(replica, ok=resp.status_code < 500, error=f"HTTP {resp.status_code}")
        if resp.status_code == 200:
            with contextlib.suppress(ValueError):
                u = usage_from(json.loads(content))
                if u is not None:
                    self.router.usage(replica, *u)
        return Response(content, status_code=resp.status_code, headers=self._response_headers(resp, replica))

    @staticmethod
    def _response_headers(resp: httpx.Response, replica: Replica) -> dict[str, str]:
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE}
        headers["x-prefixcache-replica"] = replica.url
        return headers

    async def broadcast(self, request: Request) -> Response:
        """Send the request to every healthy replica (keep-warm pins): 200 if any accepted it.
        Else the replicas' own 4xx when every one that answered refused the request (the body is
        wrong, not the fleet: its message says what to fix), 503 when no replica is healthy, and
        502 when the replicas failed. Every refusal is an error in the API's shape, with each
        replica's reply under ``replicas``."""
        raw = await request.body()
        path = request.url.path
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST}
        replies = await self.send_to_healthy(request.method, path, raw, headers)
        listed = [reply.as_dict() for reply in replies]
        if any(200 <= reply.status < 300 for reply in replies):
            return JSONResponse({"replicas": listed}, status_code=200)
        if not replies:
            status, message, code = 503, "no healthy replica to send the request to", "no_healthy_replica"
        elif all(400 <= reply.status < 500 for reply in replies):
            status, message, code = replies[0].status, _reply_message(replies[0]), "replica_refused"
        else:
            status, code = 502, "replicas_failed"
            message = "no replica accepted the request: " + "; ".join(
                f"{reply.url}: {reply.status or 'unreachable'}" for reply in replies
            )
        return JSONResponse(
            {**error_body(status, message, path, code), "replicas": listed}, status_code=status
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
