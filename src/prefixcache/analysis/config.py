"""The audit's and the simulator's settings, apart from the entry points so that the modules
doing the work (the scan's findings, the replay loop) read them without importing their callers.
``prefixcache.analysis.audit`` and ``prefixcache.analysis.simulate`` export them too."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixcache.analysis.costs import CostModel
from prefixcache.cache import model_fingerprint
from prefixcache.cache.config import DEFAULTS
from prefixcache.routing import POLICIES

#: The simulator's routings (``SimConfig.routing``), the router's policies
#: (:data:`prefixcache.routing.POLICIES`); the module docstring of
#: :mod:`~prefixcache.analysis.simulate` says what each does.
ROUTINGS = POLICIES


@dataclass(slots=True)
class AuditConfig:
    """Settings of :func:`~prefixcache.analysis.audit.audit`."""

    ttl_s: float = DEFAULTS.default_ttl_s
    block_size: int = DEFAULTS.block_size
    align_tokens: int | None = None
    min_shared_tokens: int = 64  # a busting span must sit above this much shared content
    sample_pairs: int = 48  # pairs per endpoint examined for busting spans
    pricing: str = "anthropic"
    tokenizer: str | None = None  # overrides the trace header's
    stable_quantile: float = 10.0  # percentile of shared depth taken as an endpoint's stable prefix
    version_min_share: float = 0.01  # a prefix version must serve this share of requests (and 2)
    fingerprint: str = model_fingerprint("audit", "float32", 16)
    replay: bool = True  # False: achieved = the trace's cached_tokens (0 where absent), nothing derived
    always_replay: bool = False  # replay through PrefixCache even where the scan gives the same hits


@dataclass(slots=True)
class SimConfig:
    """Settings of :func:`~prefixcache.analysis.simulate.simulate`."""

    ttl_s: float = DEFAULTS.default_ttl_s
    capacity_bytes: int = 16 << 30  # per replica
    block_size: int = DEFAULTS.block_size
    # Hits end on a multiple of this and only complete chunks are stored, as in the engine (whose
    # default prefill chunk is 512); None: the block size (the cache's own granularity).
    align_tokens: int | None = None
    replicas: int = 1
    routing: str = "round-robin"
    affinity_blocks: int = 4  # K for prefix-affinity
    seed: int = 0
    keep_warm: dict[str, int] = field(default_factory=dict)  # endpoint -> prefix tokens
    keep_warm_interval_s: float = 60.0  # the router's keep-warm round (router.keepwarm's interval_s)
    pinned_capacity_bytes: int = DEFAULTS.pinned_capacity_bytes  # per replica, as the server's
    cost: CostModel = field(default_factory=CostModel)
    pricing: tuple[str, ...] = ("anthropic", "openai", "self-hosted")
    gpu_hour: float = 2.0
    fingerprint: str = model_fingerprint("sim", "float32", 16)
