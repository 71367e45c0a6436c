"""What every fuzzed answer must be, shared by the server's and the router's fuzz tests.

A 2xx, or a 4xx in the route's error shape with a message; never a 5xx, an error event inside a
200 stream, or an exception logged past the handlers. Runs are randomized: ``SEED`` is new each
run and printed (``RERUN``); ``PREFIXCACHE_FUZZ_SEED=N`` reruns exactly those inputs, and
``PREFIXCACHE_FUZZ_EXAMPLES=500`` hunts longer.
"""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("PREFIXCACHE_FUZZ_EXAMPLES", "30"))
SEED = int(os.environ.get("PREFIXCACHE_FUZZ_SEED") or secrets.randbelow(1 << 32))
RERUN = f"(fuzz seed {SEED}: rerun with PREFIXCACHE_FUZZ_SEED={SEED})"
settings.register_profile(
    "server-fuzz",
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=False,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)
FUZZ = settings.get_profile("server-fuzz")
#: Schemathesis covers the schema's shapes; the edge cases come from the strategies: a third.
SCHEMA_FUZZ = settings(FUZZ, max_examples=max(1, EXAMPLES // 3))


class ErrorLog(logging.Handler):
    """Collects ERROR records: an exception past the handlers is logged, whatever the status."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def collecting_errors(*names: str) -> Iterator[ErrorLog]:
    """An :class:`ErrorLog` on the named loggers for the duration of the block."""
    handler = ErrorLog()
    loggers = [logging.getLogger(name) for name in names]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def check_answer(method: str, path: str, r: httpx.Response, error_log: ErrorLog) -> None:
    """A 2xx, or a 4xx in the route's error shape with a message; nothing logged as an error."""
    where = f"{method} {path} -> {r.status_code}: {r.text[:500]} {RERUN}"
    assert r.status_code < 500, where
    if r.status_code >= 400:
        body = r.json()
        if path.startswith("/v1/messages"):
            assert body["type"] == "error" and body["error"]["message"], where
        else:
            assert body["error"]["message"], where
    elif "text/event-stream" in str(r.headers.get("content-type", "")):  # a list in schemathesis
        assert '"server_error"' not in r.text and '"api_error"' not in r.text, where  # no failure mid-stream
    logged = [f"{rec.name}: {rec.getMessage()}" for rec in error_log.records]
    error_log.records.clear()
    assert not logged, f"{where}\nlogged: {logged}"
