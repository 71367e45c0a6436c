"""The router's settings (what ``prefixcache route`` sets), apart so that every router module can
read them without importing the app."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prefixcache.cache.config import DEFAULTS
from prefixcache.limits import DEFAULT_MAX_BODY_BYTES
from prefixcache.router.kv_index import FeedSpec
from prefixcache.router.policies import Policy


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
    record_ttl_s: float = DEFAULTS.default_ttl_s
    keepwarm_file: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # 413 beyond, before the body is read
    #: replica url -> where it publishes KV events (cache-aware policy only)
    kv_events: Mapping[str, FeedSpec] = field(default_factory=dict)
    dashboard_interval_s: float = 2.0  # seconds between two points of the dashboard's series
    #: CURVE client options of the KV event feeds (route --kv-events-curve-*; None: plain)
    kv_events_curve: Mapping[int, bytes] | None = None
    #: the API keys the router accepts (checked before a body is read; None: every caller)
    api_keys: frozenset[str] | None = None
