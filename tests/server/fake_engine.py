"""A model-free engine with the real engine's server-facing API, over the real PrefixCache.

Tokens are UTF-8 bytes; chat renders as ``<|role|>\\ncontent\\n``; the "model" emits
``w0 w1 w2 ...`` one word per token. ``gate`` (a threading.Event), when set up, makes every
decode step wait for it: tests use it to hold the worker deterministically (queue full,
disconnect mid-stream). Prefill runs match -> commit -> release like the real engine, so usage,
TTL classes and tenant salts are the cache's own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixcache.cache import PrefixCache


class PromptTooLongError(ValueError):
    """The prompt does not fit the context."""


@dataclass(slots=True)
class FakeUsage:
    prompt_tokens: int
    cached_tokens: int
    cache_write_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class FakeResult:
    text: str
    tokens: list[int]
    finish_reason: str
    usage: FakeUsage
    ttft_s: float
    prompt_token_ids: list[int] = field(default_factory=list)
    stop_sequence: str | None = None


class FakeEngine:
    fingerprint = "fake-model/float32/b16"
    context_len = 4096

    def __init__(self, *, block_size: int = 16, prefill_chunk: int = 16, clock: Any = None) -> None:
        kw = {"clock": clock} if clock is not None else {}
        self.cache = PrefixCache(block_size=block_size, **kw)
        self.prefill_chunk = prefill_chunk
        self.gate: threading.Event | None = None
        self.decode_steps = 0
        self.lock = threading.Lock()  # one request at a time, like the engine's single worker

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def render_ids(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>\n"
        return self.tokenize(text)

    def _ids(self, messages: Any = None, prompt: str | None = None, prompt_token_ids: Any = None) -> list[int]:
        if messages is not None:
            if not messages:
                raise ValueError("messages is empty")
            return self.render_ids(messages)
        if prompt is not None:
            return self.tokenize(prompt)
        return list(prompt_token_ids or [])

    def stream(
        self,
        messages: Any = None,
        prompt: str | None = None,
        prompt_token_ids: Any = None,
        *,
        max_tokens: int = 16,
        stop: Sequence[str] | None = None,
        tenant: str = "default",
        salt: bytes = b"",
        ttl_s: float | None = None,
        ttl_plan: Any = None,
        **_: Any,
    ) -> Iterator[str | FakeResult]:
        ids = self._ids(messages, prompt, prompt_token_ids)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) + max_tokens > self.context_len:
            raise PromptTooLongError(f"prompt ({len(ids)}) + max_tokens ({max_tokens}) exceeds the context ({self.context_len})")
        with self.lock:
            t0 = time.perf_counter()
            ns = self.cache.namespace(self.fingerprint, tenant=tenant, salt=salt)
            m = self.cache.match(ids, ns, align_tokens=self.prefill_chunk, ttl_s=ttl_s, ttl_plan=ttl_plan)
            try:
                self.cache.commit(m, lambda i: (b"kv", 1024))
                ttft = time.perf_counter() - t0
                out: list[str] = []
                reason = "length"
                hit_stop = None
                for step in range(max_tokens):
                    if self.gate is not None:
                        self.gate.wait()
                    self.decode_steps += 1
                    word = f"w{step} "
                    if stop and any(s in "".join(out) + word for s in stop):
                        hit_stop = next(s for s in stop if s in "".join(out) + word)
                        reason = "stop"
                        break
                    out.append(word)
                    yield word
                usage = FakeUsage(len(ids), m.usage.cached_tokens, m.usage.cache_write_tokens, len(out))
                yield FakeResult("".join(out), list(range(len(out))), reason, usage, ttft, ids, hit_stop)
            finally:
                self.cache.release(m)

    def generate(self, **kw: Any) -> FakeResult:
        result = None
        for item in self.stream(**kw):
            if not isinstance(item, str):
                result = item
        assert result is not None
        return result

    def held_refs(self) -> int:
        return sum(b.ref_count for b in self.cache.store)
