"""The simulator's router predicts the router that ships: the same request sequence through the
real router's policy objects (:class:`prefixcache.router.Router`) and the simulator's
(:class:`~prefixcache.analysis.replay_loop.SimRouter`) lands on the same replica, request by
request, for the policies both implement the same way (round-robin, random, prefix-affinity).
The real router keys on text; here both get the key of the same token blocks, computed by the
one key function (:mod:`prefixcache.routing`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from prefixcache.analysis.config import ROUTINGS, SimConfig
from prefixcache.analysis.replay_loop import SimRouter, affinity_key, replica_names
from prefixcache.cache import Namespace
from prefixcache.router import Policy, PrefixKey, Router
from prefixcache.routing import POLICIES, chain_root

B, K, REPLICAS = 16, 4, 5


def _requests(n: int = 400) -> list[tuple[str, np.ndarray]]:
    """Tenants x shared system prompts (some shorter than the affinity depth) x distinct tails."""
    rng = np.random.default_rng(7)
    systems = [rng.integers(0, 50_000, size=s, dtype=np.uint32) for s in (10, 40, 70, 200, 600)]
    out = []
    for _ in range(n):
        tenant = f"t{int(rng.integers(3))}"
        system = systems[int(rng.integers(len(systems)))]
        tail = rng.integers(0, 50_000, size=int(rng.integers(0, 40)), dtype=np.uint32)
        out.append((tenant, np.concatenate([system, tail])))
    return out


def _real(policy: str, requests: list[tuple[str, np.ndarray]], seed: int) -> list[int]:
    names = replica_names(REPLICAS)
    router = Router(names, policy, seed=seed)
    out = []
    for tenant, tokens in requests:
        key = PrefixKey(affinity=affinity_key(tokens, chain_root(tenant), B, K), chunks=())
        first = router.candidates(key)[0]
        router.started(first, key)
        router.finished(first, ok=True)  # nothing in flight: the load guard stays out of it
        out.append(names.index(first.url))
    return out


def _simulated(policy: str, requests: list[tuple[str, np.ndarray]], seed: int) -> list[int]:
    cfg = SimConfig(replicas=REPLICAS, routing=policy, block_size=B, affinity_blocks=K, seed=seed)
    sim = SimRouter(cfg, SimpleNamespace(caches=[None] * REPLICAS, busy=[0.0] * REPLICAS))
    return [
        sim.choose(tokens, Namespace.create("fp", tenant=tenant), 0.0, [], b"") for tenant, tokens in requests
    ]


@pytest.mark.parametrize("policy", ["round-robin", "random", "prefix-affinity"])
@pytest.mark.parametrize("seed", [0, 3])
def test_the_simulator_routes_every_request_where_the_router_does(policy: str, seed: int) -> None:
    requests = _requests()
    real = _real(policy, requests, seed)
    assert _simulated(policy, requests, seed) == real
    assert set(real) == set(range(REPLICAS))  # every replica used: not a trivial agreement


def test_round_robin_starts_at_the_first_replica_in_both() -> None:
    requests = _requests(7)
    want = [0, 1, 2, 3, 4, 0, 1]
    assert _real("round-robin", requests, 0) == _simulated("round-robin", requests, 0) == want


def test_prefix_affinity_keeps_a_tenants_shared_prefix_on_one_replica() -> None:
    requests = _requests()
    placed = _simulated("prefix-affinity", requests, 0)
    by_prefix: dict[tuple[str, bytes], set[int]] = {}
    for (tenant, tokens), r in zip(requests, placed, strict=True):
        if len(tokens) >= B * K:
            by_prefix.setdefault((tenant, tokens[: B * K].tobytes()), set()).add(r)
    assert by_prefix and all(len(rs) == 1 for rs in by_prefix.values())


def test_the_router_and_the_simulator_offer_the_same_policies() -> None:
    assert tuple(ROUTINGS) == POLICIES
    assert {p.value for p in Policy} == set(POLICIES)
