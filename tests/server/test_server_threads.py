"""The worker thread pool is sized to the queue (issue 21, item 7): anyio's default of 40 threads
was smaller than the default queue of 64, so waiting generations could hold every thread that
body parsing, cache reads and other tenants' requests need."""

from __future__ import annotations

import anyio
import pytest
from starlette.testclient import TestClient

from prefixcache.server import create_app
from prefixcache.server.app import THREAD_HEADROOM


@pytest.mark.parametrize("max_queue", [8, 64, 200])
def test_the_thread_pool_holds_the_whole_queue_and_headroom(make_engine, max_queue):
    app = create_app(make_engine(), max_queue=max_queue, model_name="test-model")
    with TestClient(app) as client:
        total = client.portal.call(lambda: _tokens())
    assert total == max(40, max_queue + THREAD_HEADROOM)


async def _tokens() -> float:
    return anyio.to_thread.current_default_thread_limiter().total_tokens
