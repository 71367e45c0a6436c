"""``--trace-log FILE``: one JSON line per generation request, in the ops tools' trace format
(version 1, see ``prefixcache.analysis.trace``), so ``prefixcache audit`` and ``simulate`` replay
what this server saw::

    {"v": 1, "ts": 1764450000.123, "tenant": "alpha", "endpoint": "/v1/chat/completions",
     "prompt_tokens": 1043, "tokens": [1, 2, ...], "cached_tokens": 1024, "cache_write_tokens": 16,
     "ttft_s": 0.041, "output_tokens": 32}

plus ``"ttl"`` (seconds) when the request asked for a TTL class, ``"prompt_cache_key"`` when an
OpenAI request sent one, and a header line
``{"v": 1, "type": "header", "tokenizer": ...}`` first in a new file when the tokenizer is known.

``endpoint`` is the route path unless the client sends ``X-Prefixcache-Endpoint`` (a label for
the calling feature, so the audit can report per feature). The prompt text (``prompt`` or
``messages``, as sent) is written only with ``--trace-text``: by default a trace holds token ids,
never words. The tenant's salt is never written.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import IO, Any

from prefixcache.server.bridge import Finished

log = logging.getLogger(__name__)

TRACE_VERSION = 1


class TraceWriter:
    """Appends trace lines to a file; thread-safe, flushed per line."""

    def __init__(self, path: str | Path, *, include_text: bool = False, tokenizer: str | None = None) -> None:
        self.path = Path(path)
        self.include_text = include_text
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._fh: IO[str] = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        if new and tokenizer:
            # The header names the tokenizer of the ids, so the audit decodes spans with it.
            self._fh.write(json.dumps({"v": TRACE_VERSION, "type": "header", "tokenizer": tokenizer}) + "\n")
            self._fh.flush()

    def record(
        self,
        *,
        tenant: str,
        endpoint: str,
        result: Finished,
        text: dict[str, Any] | None = None,
        ttl_s: float | None = None,
        cache_key: str | None = None,
        ts: float | None = None,
    ) -> None:
        """Write one request. ``text`` (``{"messages": ...}`` or ``{"prompt": ...}``) is kept only
        when the writer was built with ``include_text``."""
        u = result.usage
        line: dict[str, Any] = {
            "v": TRACE_VERSION,
            "ts": round(time.time() if ts is None else ts, 6),
            "tenant": tenant,
            "endpoint": endpoint,
            "prompt_tokens": u.prompt_tokens,
            "tokens": result.prompt_token_ids,
            "cached_tokens": u.cached_tokens,
            "cache_write_tokens": u.cache_write_tokens,
            "ttft_s": None if result.ttft_s is None else round(result.ttft_s, 6),
            "output_tokens": u.completion_tokens,
        }
        if ttl_s is not None:
            line["ttl"] = ttl_s
        if cache_key is not None:
            line["prompt_cache_key"] = cache_key[:200]
        if self.include_text and text:
            line.update(text)
        data = json.dumps(line, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            if self._fh.closed:
                return
            try:
                self._fh.write(data + "\n")
                self._fh.flush()
            except OSError:
                log.exception("cannot write the trace log %s", self.path)

    def close(self) -> None:
        with self._lock:
            self._fh.close()
