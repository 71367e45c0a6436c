"""Cache-aware routing across replicas: an OpenAI/Anthropic pass-through proxy.

``prefixcache route --replica URL ... --policy cache-aware`` runs it; as a library::

    from prefixcache.router import RouterConfig, create_router_app
    app = create_router_app(RouterConfig(replicas=["http://127.0.0.1:8001", ...], policy="cache-aware"))
"""

from __future__ import annotations

from prefixcache.router.affinity import PrefixKey, prefix_key, render_prompt
from prefixcache.router.app import create_router_app
from prefixcache.router.config import RouterConfig
from prefixcache.router.keepwarm import KeepWarm, WarmPrefix
from prefixcache.router.policies import Policy, PrefixRecord, Replica, Router, rendezvous
from prefixcache.router.proxy import usage_from

__all__ = [
    "KeepWarm",
    "Policy",
    "PrefixKey",
    "PrefixRecord",
    "Replica",
    "Router",
    "RouterConfig",
    "WarmPrefix",
    "create_router_app",
    "prefix_key",
    "render_prompt",
    "rendezvous",
    "usage_from",
]
