"""``--trace-log FILE``: one JSON line per generation request, in the ops tools' trace format
(version 1, see ``prefixcache.analysis.trace``), so ``prefixcache audit`` and ``simulate`` replay
what this server saw::

    {"v": 1, "ts": 1764450000.123, "tenant": "alpha", "endpoint": "/v1/chat/completions",
     "prompt_tokens": 1043, "tokens": [1, 2, ...], "cached_tokens": 1024, "cache_write_tokens": 16,
     "ttft_s": 0.041, "output_tokens": 32}

plus ``"cache_reason"`` and ``"cache_missed_tokens"`` (why the cache read ended where it did,
see ``prefixcache.cache.reasons``; ``"divergence_token"`` for ``diverged``), ``"ttl"`` (seconds)
when the request asked for a TTL class, ``"prompt_cache_key"`` when an OpenAI request sent one,
and a header line ``{"v": 1, "type": "header", "tokenizer": ...}`` first in a new file when the
tokenizer is known.

``endpoint`` is the route path unless the client sends ``X-Prefixcache-Endpoint`` (a label for
the calling feature, so the audit can report per feature). The prompt text (``prompt`` or
``messages``, as sent) is written only with ``--trace-text``: by default a trace holds token ids,
never words. The tenant's salt is never written.

Privacy mode (``--trace-keys-only``) writes neither text nor token ids: each line carries
``"block_keys"`` (hex), ``"block_size"`` and ``"prompt_tokens"`` instead of ``"tokens"``, which
``prefixcache audit`` and ``simulate`` replay (equal key chains are equal prefixes). The keys are
chained like the cache's, from a root of the tenant's secret salt and a trace label, so nobody
without the server's salt secret can test a guessed prompt against them, one tenant's keys never
equal another's, and they do not name the cache's own entries (in Redis or on disk).

The file is created 0600 and the directories it creates 0700 (the umask can only narrow them):
a trace says what tenants sent, or at least which prompts they repeated.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import time
from pathlib import Path
from typing import IO, Any

from prefixcache.analysis.trace.format import FORMAT_VERSION
from prefixcache.analysis.trace.writer import TraceWriter
from prefixcache.cache.keys import block_keys
from prefixcache.server.bridge import Finished

log = logging.getLogger(__name__)

#: Mixed into the root of privacy-mode keys, so that they never equal the cache's keys.
TRACE_KEY_LABEL = b"prefixcache-trace-keys-v1"


def make_private_dirs(directory: Path) -> None:
    """Create ``directory`` and its missing parents, each 0700 (existing ones are left as they are)."""
    missing = []
    for d in (directory, *directory.parents):
        if d.exists():
            break
        missing.append(d)
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # created meanwhile by someone else
            d.mkdir(mode=0o700)


def open_private(path: Path) -> IO[str]:
    """``path`` opened for appending, created 0600 (an existing file keeps its mode; a warning
    says when others can read it)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    mode = os.fstat(fd).st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning(
            "the trace log %s is readable by other users (mode %o); chmod 600 it", path, stat.S_IMODE(mode)
        )
    return os.fdopen(fd, "a", encoding="utf-8")


def trace_keys(tokens: list[int], salt: bytes, block_size: int) -> list[str]:
    """Privacy-mode keys of a prompt: the cache's chaining from a trace-only root of ``salt``."""
    root = hashlib.sha256(TRACE_KEY_LABEL + b"\x00" + salt).digest()
    return [k.hex() for k in block_keys(tokens, root, block_size)]


def engine_header(engine: Any) -> dict[str, Any]:
    """What a trace header records of the engine: its KV dtype and cache bytes per token (from
    its block layout), and its block size; empty for an engine without a layout."""
    layout = getattr(engine, "block_layout", None)
    shape, dtype = getattr(layout, "shape", None), getattr(layout, "dtype", None)
    if not shape or not isinstance(dtype, str):
        return {}
    import torch

    per_block = 1
    for d in shape:
        per_block *= int(d)
    block = int(shape[3])
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    return {"dtype": dtype, "kv_bytes_per_token": per_block // block * itemsize, "block_size": block}


class TraceLog:
    """The server's trace log: one line per request through the analysis' :class:`TraceWriter`
    (the file created 0600, flushed per line). ``keys_only``: privacy mode (block keys of
    ``block_size`` tokens instead of token ids; see the module docstring)."""

    def __init__(
        self,
        path: str | Path,
        *,
        include_text: bool = False,
        tokenizer: str | None = None,
        keys_only: bool = False,
        block_size: int = 16,
        header: dict[str, Any] | None = None,
    ) -> None:
        if keys_only and include_text:
            raise ValueError("a keys-only trace cannot include the prompt text: choose one")
        self.path = Path(path)
        self.include_text = include_text
        self.keys_only = keys_only
        self.block_size = block_size
        make_private_dirs(self.path.parent)
        new = not self.path.exists() or self.path.stat().st_size == 0
        # The header names the tokenizer of the ids, so the audit decodes spans with it, and the
        # KV dtype and bytes per token, so the simulator sizes the cache as the server did.
        head = ({"tokenizer": tokenizer} if tokenizer else {}) | (header or {})
        self._writer = TraceWriter(
            self.path, header=head if new and head else None, opener=open_private, ensure_ascii=False
        )

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
        salt: bytes = b"",
    ) -> None:
        """Write one request. ``text`` (``{"messages": ...}`` or ``{"prompt": ...}``) is kept only
        when the writer was built with ``include_text``; ``salt`` (the tenant's) roots the keys
        of a keys-only writer."""
        u = result.usage
        prompt: dict[str, Any] = {"tokens": result.prompt_token_ids}
        if self.keys_only:
            keys = trace_keys(result.prompt_token_ids, salt, self.block_size)
            prompt = {"block_keys": keys, "block_size": self.block_size}
        line: dict[str, Any] = {
            "v": FORMAT_VERSION,
            "ts": round(time.time() if ts is None else ts, 6),
            "tenant": tenant,
            "endpoint": endpoint,
            "prompt_tokens": u.prompt_tokens,
            **prompt,
            "cached_tokens": u.cached_tokens,
            "cache_write_tokens": u.cache_write_tokens,
            "ttft_s": None if result.ttft_s is None else round(result.ttft_s, 6),
            "output_tokens": u.completion_tokens,
        }
        if u.cache_reason is not None:
            line["cache_reason"] = u.cache_reason.reason.value
            line["cache_missed_tokens"] = u.cache_reason.cache_missed_tokens
            if u.cache_reason.token_index is not None:
                line["divergence_token"] = u.cache_reason.token_index
        if ttl_s is not None:
            line["ttl"] = ttl_s
        if cache_key is not None:
            line["prompt_cache_key"] = cache_key[:200]
        if self.include_text and text:
            line.update(text)
        if self._writer.closed:
            return
        try:
            self._writer.write(line)
        except ValueError:  # closed meanwhile (shutdown)
            return
        except OSError:
            log.exception("cannot write the trace log %s", self.path)

    def close(self) -> None:
        self._writer.close()
