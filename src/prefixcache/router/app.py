"""The router's HTTP side: an OpenAI and Anthropic pass-through proxy in front of replicas.

    POST /v1/chat/completions, /v1/completions, /v1/messages, /v1/messages/count_tokens
         and any other path: proxied to the replica the policy picks (streaming relayed as is)
    POST /v1/cache/pin, DELETE /v1/cache/pin: sent to every healthy replica (keep-warm)
    GET  /health                 200 while at least one replica is healthy, else 503
    GET  /metrics                Prometheus: per-replica routing, in-flight, hit rate, fail-overs
    GET  /router/replicas        the same as JSON

Fail-over contract: a request is retried on the next replica when the chosen one fails at the
transport level (refused connection, reset, timeout) *before any byte went to the client*, which
for a non-streamed request includes a replica dying mid-request. Once a streamed response has
started, a failure truncates it (the client sees the broken stream) and is counted as failed.
A replica that refuses a connection is marked down at once; the health loop
(GET /health every ``health_interval_s``) brings it back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from prefixcache.router.affinity import PrefixKey, prefix_key
from prefixcache.router.keepwarm import KeepWarm
from prefixcache.router.policies import Policy, Replica, Router

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
_DROP_RESPONSE = {"content-length", "connection", "keep-alive", "transfer-encoding", "content-encoding"}


@dataclass(slots=True)
class RouterConfig:
    """Everything ``prefixcache route`` sets."""

    replicas: Sequence[str]
    policy: Policy | str = Policy.CACHE_AWARE
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0
    connect_timeout_s: float = 2.0
    read_timeout_s: float = 600.0
    chunk_chars: int = 256
    affinity_chars: int = 1024
    load_factor: float = 2.0
    load_slack: int = 4
    record_ttl_s: float = 300.0
    keepwarm_file: str | None = None


def usage_from(obj: Any) -> tuple[int, int] | None:
    """(prompt tokens, cached tokens) from an OpenAI or Anthropic response or stream event."""
    if not isinstance(obj, dict):
        return None
    u = obj.get("usage")
    if not isinstance(u, dict) and isinstance(obj.get("message"), dict):
        u = obj["message"].get("usage")  # Anthropic message_start
    if not isinstance(u, dict):
        return None
    if isinstance(u.get("prompt_tokens"), int):
        details = u.get("prompt_tokens_details") or {}
        return u["prompt_tokens"], int(details.get("cached_tokens") or 0)
    if isinstance(u.get("input_tokens"), int):
        read = int(u.get("cache_read_input_tokens") or 0)
        created = int(u.get("cache_creation_input_tokens") or 0)
        return u["input_tokens"] + read + created, read
    return None


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
        results = await asyncio.gather(
            *(
                self.send_one(request.method, r, request.url.path, raw, headers)
                for r in self.router.replicas
                if r.healthy
            )
        )
        ok = any(200 <= status < 300 for _, status, _ in results)
        return JSONResponse(
            {"replicas": [{"url": url, "status": status, "body": body} for url, status, body in results]},
            status_code=200 if ok else 502,
        )

    async def send_one(
        self, method: str, replica: Replica, path: str, raw: bytes, headers: dict[str, str]
    ) -> tuple[str, int, Any]:
        """One request to one replica, no fail-over: (url, HTTP status or 0 if unreachable, body)."""
        try:
            resp = await self.client.request(method, replica.url + path, content=raw, headers=headers)
        except httpx.TransportError as exc:
            return replica.url, 0, f"{type(exc).__name__}: {exc}"
        try:
            body: Any = resp.json()
        except ValueError:
            body = resp.text[:500]
        return replica.url, resp.status_code, body

    async def check_health(self) -> None:
        async def one(r: Replica) -> None:
            try:
                resp = await self.client.get(r.url + "/health", timeout=self.config.health_timeout_s)
                self.router.set_health(r, resp.status_code == 200, f"health: HTTP {resp.status_code}")
            except httpx.HTTPError as exc:
                self.router.set_health(r, False, f"health: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(one(r) for r in self.router.replicas))


def render_metrics(router: Router) -> bytes:
    """Prometheus text for the router (per-replica labels)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _Collector:
        def collect(self) -> list[Any]:
            snap = router.snapshot()
            fams: list[Any] = []
            spec = [
                ("requests", "routed", "Requests sent to the replica (fail-over attempts included).", True),
                ("completed", "completed", "Requests the replica answered.", True),
                (
                    "failed",
                    "failed",
                    "Requests that failed at the replica after nothing could be retried.",
                    True,
                ),
                ("connect_failures", "connect_failures", "Requests that never reached the replica.", True),
                ("prompt_tokens", "prompt_tokens", "Prompt tokens the replica reported.", True),
                ("cached_tokens", "cached_tokens", "Prompt tokens the replica served from cache.", True),
                ("in_flight", "in_flight", "Requests in flight at the replica.", False),
                ("healthy", "healthy", "1 while the replica passes health checks.", False),
                ("hit_rate", "hit_rate", "cached_tokens / prompt_tokens at the replica.", False),
            ]
            for name, field, doc, counter in spec:
                metric = f"prefixcache_router_{name}"
                fam: Any = (
                    CounterMetricFamily(metric, doc, labels=["replica"])
                    if counter
                    else GaugeMetricFamily(metric, doc, labels=["replica"])
                )
                for r in snap:
                    fam.add_metric([str(r["url"])], float(r[field]))  # type: ignore[arg-type]
                fams.append(fam)
            total_p = sum(int(r["prompt_tokens"]) for r in snap)  # type: ignore[call-overload]
            total_c = sum(int(r["cached_tokens"]) for r in snap)  # type: ignore[call-overload]
            g = GaugeMetricFamily(
                "prefixcache_router_hit_rate_total", "cached / prompt tokens over all replicas."
            )
            g.add_metric([], total_c / total_p if total_p else 0.0)
            fams.append(g)
            fo = CounterMetricFamily("prefixcache_router_failovers", "Requests moved to another replica.")
            fo.add_metric([], router.failovers)
            fams.append(fo)
            lf = CounterMetricFamily(
                "prefixcache_router_load_fallbacks", "Routing overridden by the load guard."
            )
            lf.add_metric([], router.load_fallbacks)
            fams.append(lf)
            rec = GaugeMetricFamily(
                "prefixcache_router_prefix_record_entries", "Chunk hashes in the prefix record."
            )
            rec.add_metric([], len(router.record))
            fams.append(rec)
            return fams

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return generate_latest(registry)


def create_router_app(config: RouterConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The router app. ``transport`` lets tests route to in-process apps."""
    router = Router(
        config.replicas,
        config.policy,
        load_factor=config.load_factor,
        load_slack=config.load_slack,
        record_ttl_s=config.record_ttl_s,
    )
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
        limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
            proxy = Proxy(router, config, client)
            state["proxy"] = proxy
            tasks = [asyncio.create_task(_health_loop(proxy, config.health_interval_s))]
            keepwarm = KeepWarm.load(config.keepwarm_file) if config.keepwarm_file else None
            if keepwarm is not None:
                state["keepwarm"] = keepwarm
                tasks.append(asyncio.create_task(keepwarm.run(proxy)))
            try:
                yield
            finally:
                for t in tasks:
                    t.cancel()
                for t in tasks:
                    with contextlib.suppress(asyncio.CancelledError):
                        await t

    app = FastAPI(title="prefixcache router", version="0.1.0", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        up = sum(1 for r in router.replicas if r.healthy)
        body = {"status": "ok" if up else "down", "healthy_replicas": up, "replicas": len(router.replicas)}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render_metrics(router), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/router/replicas")
    async def replicas() -> Any:
        return {"policy": router.policy.value, "replicas": router.snapshot(), "failovers": router.failovers}

    @app.api_route("/v1/cache/pin", methods=["POST", "DELETE"])
    async def pin(request: Request) -> Response:
        return await state["proxy"].broadcast(request)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def proxied(path: str, request: Request) -> Response:
        return await state["proxy"].handle(request)

    return app


async def _health_loop(proxy: Proxy, interval_s: float) -> None:
    while True:
        try:
            await proxy.check_health()
        except Exception:  # the loop must outlive any single failure
            log.exception("router: health check round failed")
        await asyncio.sleep(interval_s)
