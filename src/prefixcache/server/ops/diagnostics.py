"""Anthropic's cache diagnostics on ``POST /v1/messages``.

A client opts in by sending ``"diagnostics": {"previous_message_id": ...}`` (``null`` on the
first turn; the beta header ``anthropic-beta: cache-diagnosis-2026-04-07`` is accepted and not
required). For every such request the server remembers a small fingerprint of the request
(model, hashes of the system prompt, of the tools and of each message: never the text) under the
answer's ``id``, in a bounded record per tenant. The next request names that id, and the answer
carries Anthropic's shape::

    "diagnostics": {"cache_miss_reason": {"type": "system_changed", "cache_missed_input_tokens": 1536}}

or ``"diagnostics": null`` when nothing diverged. The comparison is structural, as the hosted
API's: ``model_changed``, ``system_changed``, ``tools_changed``, then ``messages_changed`` (an
earlier message edited, removed or reordered; appending turns is no change);
``previous_message_not_found`` when the id is not in the caller's record (another tenant's ids
are never found); ``unavailable`` when the structure matches but the cache cannot say more
(a tier was down, or the prompt renders differently, e.g. another ``tool_choice``).
``cache_missed_input_tokens``: the readable tokens (full blocks, the last token excepted) the
previous prompt and this one could have shared, the fewer of the two, less those this request
read: the ``prefixcache`` object's ``cache_missed_tokens`` (docs/server.md). Our own
``prefixcache`` object says exactly why the read ended (expired, evicted, ...), which a
structural comparison cannot.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from prefixcache.cache.reasons import Reason, missed_tokens
from prefixcache.cache.stats import Usage
from prefixcache.server.anthropic.schemas import MessagesRequest

#: Fingerprints kept per tenant (the oldest goes first).
PER_TENANT = 512


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What the comparison needs of one request (hashes and a count: no prompt text)."""

    model: str
    system: bytes
    tools: bytes
    tool_choice: bytes
    messages: tuple[bytes, ...]
    prompt_tokens: int


def _digest(value: Any) -> bytes:
    return hashlib.sha256(json.dumps(_without_cache_control(value), sort_keys=True).encode()).digest()


def _without_cache_control(value: Any) -> Any:
    """``value`` without its ``cache_control`` markers: a breakpoint moves no prompt token."""
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


def fingerprint(body: MessagesRequest, prompt_tokens: int) -> Fingerprint:
    return Fingerprint(
        model=body.model,
        system=_digest([b.model_dump(mode="json") for b in body.system_blocks()]),
        tools=_digest([t.model_dump(mode="json") for t in body.tools or []]),
        tool_choice=_digest(body.tool_choice.model_dump(mode="json") if body.tool_choice else None),
        messages=tuple(_digest(m.model_dump(mode="json")) for m in body.messages),
        prompt_tokens=prompt_tokens,
    )


def compare(
    previous: Fingerprint | None, now: Fingerprint, usage: Usage, block_size: int, align: int | None = None
) -> dict[str, Any] | None:
    """Anthropic's ``diagnostics`` object for a request compared with ``previous`` (None: the
    id was not found), or None when nothing diverged. ``cache_missed_input_tokens`` is
    :func:`~prefixcache.cache.reasons.missed_tokens`, as the ``prefixcache`` object's figure."""
    if previous is None:
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    missed = missed_tokens(previous.prompt_tokens, now.prompt_tokens, usage.cached_tokens, block_size, align)
    for kind, changed in (
        ("model_changed", previous.model != now.model),
        ("system_changed", previous.system != now.system),
        ("tools_changed", previous.tools != now.tools),
        ("messages_changed", now.messages[: len(previous.messages)] != previous.messages),
    ):
        if changed:
            return {"cache_miss_reason": {"type": kind, "cache_missed_input_tokens": missed}}
    reason = usage.cache_reason
    if previous.tool_choice != now.tool_choice or (
        reason is not None and reason.reason in (Reason.TIER_UNAVAILABLE, Reason.DIVERGED)
    ):
        return {"cache_miss_reason": {"type": "unavailable"}}
    return None


class DiagnosticsRecord:
    """Fingerprints by answer id, at most :data:`PER_TENANT` per tenant. Thread-safe."""

    def __init__(self, per_tenant: int = PER_TENANT) -> None:
        self.per_tenant = per_tenant
        self._by_tenant: dict[str, OrderedDict[str, Fingerprint]] = {}
        self._lock = threading.Lock()

    def remember(self, tenant: str, message_id: str, fp: Fingerprint) -> None:
        with self._lock:
            record = self._by_tenant.setdefault(tenant, OrderedDict())
            record[message_id] = fp
            if len(record) > self.per_tenant:
                record.popitem(last=False)

    def find(self, tenant: str, message_id: str) -> Fingerprint | None:
        """The fingerprint of ``message_id`` among ``tenant``'s own answers, or None."""
        with self._lock:
            record = self._by_tenant.get(tenant)
            return None if record is None else record.get(message_id)

    def __len__(self) -> int:
        with self._lock:
            return sum(len(r) for r in self._by_tenant.values())
