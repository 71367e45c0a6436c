"""The external routers' rows of ``bench_cluster.py``: SMG (``cache_aware``) and vllm-router
(``kv_aware`` on the replicas' KV events) in front of the same replicas, on the same trace shape.

Also what every row reports beside the hit rate: the requests each replica served (read from
the replicas' own ``prefixcache_requests_total``, so it is the same for every router), TTFT p50
and output tokens per second.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx

from prefixcache.commands.cluster import free_port
from prefixcache.commands.ext_routers import EventSource, RouterProcess, find_router, router_command

EXTERNAL = ("smg", "vllm-router")

#: SMG reads a replica's model id from ``GET /v1/models``, which needs a key here; given one
#: (``--api-key``) it also requires that key of every client, so its row runs as one tenant. The
#: tenants' system prompts differ, so no row shares a prefix across tenants and the hit rates
#: compare.
SMG_KEY = "key-tenant-a"
_CHAT = re.compile(r'^prefixcache_requests_total\{route="/v1/chat/completions",status="200"\} (\S+)$', re.M)


@contextlib.contextmanager
def external_front(
    name: str, urls: list[str], feeds: dict[str, Any] | None, model: str, api_key: str | None = None
) -> Iterator[str]:
    """Router ``name`` (its binary from the routers extra) in front of ``urls``; yields its URL.
    ``feeds``: the replicas' KV event sockets (vllm-router subscribes to them). ``api_key``: the
    key it sends the replicas (SMG: and then requires of its clients)."""
    port = free_port()
    events = [EventSource(u, f.endpoint, f.replay_endpoint) for u, f in (feeds or {}).items()]
    binary = find_router(name)
    ready = {"authorization": f"Bearer {api_key or SMG_KEY}"}  # the replicas want a key
    cmd = router_command(
        name, binary, urls, host="127.0.0.1", port=port, events=events, model=model, api_key=api_key
    )
    with (
        tempfile.TemporaryFile() as log,
        RouterProcess(cmd, f"http://127.0.0.1:{port}", log=log, ready_s=120, headers=ready) as router,
    ):
        yield router.url


def served(urls: list[str], key: str) -> dict[str, int]:
    """Chat requests each replica has answered (200) since it started, from its /metrics."""
    out = {}
    for url in urls:
        text = httpx.get(url + "/metrics", headers={"authorization": f"Bearer {key}"}, timeout=30).text
        m = _CHAT.search(text)
        out[url] = int(float(m.group(1))) if m else 0
    return out


def spread(counts: list[int]) -> float:
    """Load spread: the busiest replica's requests over the mean (1.0 is even; N replicas, one
    doing all: N)."""
    return max(counts) / (sum(counts) / len(counts)) if counts and sum(counts) else float("nan")


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
