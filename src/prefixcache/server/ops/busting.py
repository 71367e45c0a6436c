"""Cache busting detected live: each tenant's endpoints watched over a sliding window.

The audit (``prefixcache audit``) finds busting in a trace after the fact; this module finds it
while the traffic flows, with the same detector
(:class:`~prefixcache.analysis.trace.spans.BustingDetector`): each finished request of an endpoint is
paired with the most similar of that endpoint's last ``window`` prompts (the one it shares the
longest token prefix with; the earliest on a tie), and the pair goes to the endpoint's detector,
whose window holds the last ``window`` pairs. A finding is a variable span (timestamp, uuid,
hex id, counter, other) after which the two prompts agree again for at least ``min_shared``
tokens, at the same token position in at least a tenth of the window's pairs (and two).
Multi-turn chats (a request extends an earlier one), RAG tails (the prompts never agree again
after the difference) and distinct system prompts raise nothing.

What it reports: ``GET /v1/cache/report`` (the caller's tenant only; each endpoint's
``busting`` list has the audit's schema), one warning in the log per new finding, and the metrics
``prefixcache_cache_busting_findings_total{kind}`` (findings raised since start) and
``prefixcache_cache_busting_active_findings`` (findings in the current windows). No tenant or
endpoint label: the per-tenant view is the report route, and labels from client-chosen endpoint
names would be unbounded.

Cost and bounds. The request path only appends ``(tenant, endpoint, token ids)`` to a bounded
queue (:meth:`BustingWatch.submit`; full: the request is skipped and counted); one daemon thread
does the work. Memory: at most ``max_tenants`` tenants x ``max_endpoints`` endpoints each (least
recently seen dropped first) x ``window`` prompts of at most ``max_prompt_tokens`` tokens
(uint32): at the defaults (64 x 8 x 32 x 8,192 x 4 bytes) 8 MiB per tenant, 512 MiB in all.
Work per request: ``window`` vectorised prefix comparisons, then the detector's
resynchronisation search (at most 256 window searches) and, for a busting pair, decoding about a
hundred tokens of context.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixcache.analysis.audit_findings import busting_rows
from prefixcache.analysis.costs import pricing_profile
from prefixcache.analysis.trace.spans import BustingDetector, Finding, Pair

log = logging.getLogger(__name__)

DEFAULT_WINDOW = 32  # prompts (and pairs) per endpoint
DEFAULT_MAX_ENDPOINTS = 8  # per tenant
DEFAULT_MAX_TENANTS = 64
DEFAULT_MAX_PROMPT_TOKENS = 8192  # tokens kept of each prompt (busting below them goes unseen)
DEFAULT_QUEUE = 1024  # requests waiting for the watcher's thread before new ones are skipped
_MAX_REPORTED = 256  # findings remembered as reported, per endpoint
REPORT_PRICING = "anthropic"  # the busting rows' dollar figures (as the audit's default)


@dataclass(slots=True)
class _Endpoint:
    """One endpoint's window: its last prompts, its detector, and what was already reported."""

    detector: BustingDetector
    prompts: deque[np.ndarray]
    requests: int = 0
    reported: set[tuple[str, int]] = field(default_factory=set)
    active: int = 0  # findings in the window at the last request


class LiveBusting:
    """The watch itself, without a thread (the tests drive it directly). Thread-safe.

    ``tokenizer_loader()``: the tokenizer of the prompts' ids (called on the first busting
    candidate, to classify its span). ``on_finding(tenant, endpoint, finding)`` is called once per
    new (tenant, endpoint, kind, start token), after the warning is logged."""

    def __init__(
        self,
        tokenizer_loader: Callable[[], Any],
        *,
        window: int = DEFAULT_WINDOW,
        min_shared: int = 64,
        max_endpoints: int = DEFAULT_MAX_ENDPOINTS,
        max_tenants: int = DEFAULT_MAX_TENANTS,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        on_finding: Callable[[str, str, Finding], None] | None = None,
        log_examples: bool = True,
    ) -> None:
        """``log_examples``: quote a finding's example span in the log warning (off under the
        trace's privacy mode, ``--trace-keys-only``: the span is prompt text)."""
        if window < 2:
            raise ValueError(f"window={window}: a finding needs two pairs, give at least 2")
        self.window = window
        self.min_shared = min_shared
        self.max_endpoints = max_endpoints
        self.max_tenants = max_tenants
        self.max_prompt_tokens = max_prompt_tokens
        self.on_finding = on_finding
        self.log_examples = log_examples
        self._tokenizer_loader = tokenizer_loader
        self._tokenizer: Any = None
        self._tenants: OrderedDict[str, OrderedDict[str, _Endpoint]] = OrderedDict()
        self._lock = threading.Lock()
        self.raised: dict[str, int] = {}  # kind -> findings raised since start

    def _load_tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._tokenizer_loader()
        return self._tokenizer

    def observe(self, tenant: str, endpoint: str, tokens: Any, ts: float) -> list[Finding]:
        """One finished request (``tokens``: its prompt's ids). Returns the findings it raised
        (new ones only: a finding already reported for this endpoint is not raised again)."""
        prompt = np.asarray(tokens, dtype=np.uint32)[: self.max_prompt_tokens]
        with self._lock:
            state = self._endpoint(tenant, endpoint)
            state.requests += 1
            reference, diverge = _closest(prompt, state.prompts)
            state.prompts.append(prompt)
            if reference is None:
                return []
            observation = state.detector.add(Pair(state.requests - 1, ts, prompt, reference, diverge))
            if not observation and not state.active:
                return []  # nothing new, and the window held no finding
            findings = state.detector.findings()
            state.active = len(findings)
            new = [f for f in findings if (f.kind, f.start_token) not in state.reported]
            if len(state.reported) > _MAX_REPORTED:
                state.reported.clear()  # (a pathological endpoint: bounded, at the price of repeats)
            for f in new:
                state.reported.add((f.kind, f.start_token))
                self.raised[f.kind] = self.raised.get(f.kind, 0) + 1
        for f in new:
            log.warning(
                "cache busting: tenant %r, endpoint %r: a %s at token %d (e.g. %r) varies from request "
                "to request above %.0f shared tokens, which are prefilled again every time; move it "
                "below the shared content",
                tenant,
                endpoint,
                f.kind,
                f.start_token,
                (f.examples[-1][1] if f.examples else "") if self.log_examples else "(withheld)",
                float(np.mean(f.shared_after)),
            )
            if self.on_finding is not None:
                self.on_finding(tenant, endpoint, f)
        return new

    def _endpoint(self, tenant: str, endpoint: str) -> _Endpoint:
        """The endpoint's state, created on first sight; the least recently seen tenant or
        endpoint beyond the bounds is dropped. Caller holds the lock."""
        endpoints = self._tenants.get(tenant)
        if endpoints is None:
            endpoints = self._tenants[tenant] = OrderedDict()
            if len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        self._tenants.move_to_end(tenant)
        state = endpoints.get(endpoint)
        if state is None:
            detector = BustingDetector(self._load_tokenizer, min_shared=self.min_shared, window=self.window)
            state = endpoints[endpoint] = _Endpoint(detector, deque(maxlen=self.window))
            if len(endpoints) > self.max_endpoints:
                endpoints.popitem(last=False)
        endpoints.move_to_end(endpoint)
        return state

    def report(self, tenant: str) -> dict[str, Any]:
        """``tenant``'s endpoints and their current findings (only this tenant's: the route's body)."""
        pricing = pricing_profile(REPORT_PRICING)
        with self._lock:
            endpoints = list(self._tenants.get(tenant, {}).items())
            rows = [
                {
                    "endpoint": name,
                    "requests": state.requests,
                    "window_pairs": len(state.detector),
                    "busting": busting_rows(
                        state.detector.findings(), state.requests, len(state.detector), pricing
                    ),
                }
                for name, state in endpoints
            ]
        return {"tenant": tenant, "window": self.window, "pricing": pricing.name, "endpoints": rows}

    def active_findings(self) -> int:
        """Findings in every endpoint's window as of its last request."""
        with self._lock:
            return sum(s.active for endpoints in self._tenants.values() for s in endpoints.values())

    def memory_bytes(self) -> int:
        """Bytes of prompts held (the bulk of the watch's memory)."""
        with self._lock:
            return sum(
                p.nbytes
                for endpoints in self._tenants.values()
                for s in endpoints.values()
                for p in s.prompts
            )


def _closest(prompt: np.ndarray, earlier: deque[np.ndarray]) -> tuple[np.ndarray | None, int]:
    """(the earlier prompt sharing the longest token prefix with ``prompt``, the first index
    where they differ); the earliest wins a tie; (None, 0) when there is none."""
    best: np.ndarray | None = None
    best_diff = -1
    for other in earlier:
        n = min(len(prompt), len(other))
        neq = np.flatnonzero(prompt[:n] != other[:n])
        diff = int(neq[0]) if len(neq) else n
        if diff > best_diff:
            best, best_diff = other, diff
    return best, max(best_diff, 0)


class BustingWatch:
    """:class:`LiveBusting` behind a bounded queue and one daemon thread (the server's)."""

    def __init__(self, live: LiveBusting, *, max_queue: int = DEFAULT_QUEUE) -> None:
        self.live = live
        self.skipped = 0  # requests not watched because the queue was full
        self._queue: queue.Queue[tuple[str, str, list[int], float] | None] = queue.Queue(max_queue)
        self._thread = threading.Thread(target=self._run, name="prefixcache-busting", daemon=True)
        self._thread.start()

    def submit(self, tenant: str, endpoint: str, token_ids: list[int]) -> None:
        """Queue one finished request; never blocks (a full queue skips it)."""
        try:
            self._queue.put_nowait((tenant, endpoint, token_ids, time.time()))
        except queue.Full:
            self.skipped += 1

    def wait_idle(self) -> None:
        """Return once every request queued so far has been examined."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self.live.observe(*item)
            except Exception:  # a bad prompt must not stop the watch
                log.exception("cache busting watch: a request could not be examined")
            finally:
                self._queue.task_done()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    def collector(self) -> Collector:
        return _BustingCollector(self)


class _BustingCollector(Collector):
    def __init__(self, watch: BustingWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterator[Metric]:
        raised = CounterMetricFamily(
            "prefixcache_cache_busting_findings",
            "Cache-busting findings raised (a variable span above shared content), by kind.",
            labels=["kind"],
        )
        for kind in sorted(set(self.watch.live.raised) | {"timestamp", "uuid", "hex_id", "counter", "other"}):
            raised.add_metric([kind], self.watch.live.raised.get(kind, 0))
        active = GaugeMetricFamily(
            "prefixcache_cache_busting_active_findings",
            "Cache-busting findings in the endpoints' current windows (all tenants).",
        )
        active.add_metric([], self.watch.live.active_findings())
        yield from (raised, active)
