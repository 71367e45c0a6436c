"""Whose prompt text a caller may see: miss reasons, dashboard previews, busting examples.

A miss reason's ``divergence.cached_text`` decodes the *cached* side of a divergence: when a
namespace is shared (several API keys of one tenant, or no key file), that is whoever wrote the
cached prompt, and a few requests would recover another caller's prompt. The rule, by
:class:`TextPolicy`:

* ``all``: no key file on a loopback address: the single user sees everything (as before);
* ``own``: with API keys, cached-side text only when the same API key wrote that prefix (the
  block key of the cached side's block that holds the text is among the blocks that key's own
  prompts held), or to an admin tenant; otherwise the structure alone (token index, lengths);
* ``none``: no key file on a non-loopback address (``--allow-unauthenticated``): no credential
  tells callers apart, so no cached-side text at all.

:class:`WrittenPrefixes` is the record of which blocks each API key's prompts held: at most
``per_credential`` block keys per key (least recently sent dropped first) and at most
``max_credentials`` keys, 32 bytes each.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

from prefixcache.cache.reasons import CacheReason
from prefixcache.cache.stats import Usage
from prefixcache.server.auth import Tenant


class TextPolicy(StrEnum):
    ALL = "all"
    OWN = "own"
    NONE = "none"

    @staticmethod
    def default(has_keys: bool) -> TextPolicy:
        return TextPolicy.OWN if has_keys else TextPolicy.ALL


class WrittenPrefixes:
    """Per credential, the block keys its prompts held (bounded; thread-safe)."""

    def __init__(self, per_credential: int = 16_384, max_credentials: int = 4_096) -> None:
        self.per_credential = per_credential
        self.max_credentials = max_credentials
        self._keys: OrderedDict[str, OrderedDict[bytes, None]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, credential: str, keys: Sequence[bytes]) -> None:
        with self._lock:
            record = self._keys.get(credential)
            if record is None:
                record = self._keys[credential] = OrderedDict()
                if len(self._keys) > self.max_credentials:
                    self._keys.popitem(last=False)
            self._keys.move_to_end(credential)
            for key in keys[-self.per_credential :]:
                record[bytes(key)] = None
                record.move_to_end(bytes(key))
            while len(record) > self.per_credential:
                record.popitem(last=False)

    def wrote(self, credential: str, key: bytes) -> bool:
        with self._lock:
            record = self._keys.get(credential)
            return record is not None and bytes(key) in record


#: Matches no caller's credential (the dashboard's filter when no preview may be shown).
NO_CREDENTIAL = "-"
#: ``keys(tenant, token_ids)``: the cache's block keys of those tokens in the tenant's namespace.
KeysOf = Callable[[Tenant, list[int]], Sequence[bytes]]


class CallerText:
    """Applies the :class:`TextPolicy` to one server's answers and dashboard."""

    def __init__(
        self, policy: TextPolicy, keys: KeysOf, block_size: int, shared: frozenset[str] = frozenset()
    ) -> None:
        """``shared``: the tenants of several API keys (the busting report's examples, drawn
        from every request of a tenant, are withheld there)."""
        self.policy = policy
        self.keys = keys
        self.block_size = block_size
        self.shared = shared
        self.written = WrittenPrefixes()

    def sees_everything(self, tenant: Tenant) -> bool:
        """Whether ``tenant`` may see every caller's text (the single user, or an admin)."""
        return self.policy is TextPolicy.ALL or (self.policy is TextPolicy.OWN and tenant.admin)

    def previews_for(self, tenant: Tenant) -> str | None:
        """The dashboard's preview filter for ``tenant``: None (every preview) or the
        credential whose own prefixes' previews it may see (under ``none``, a value no
        credential has: no preview)."""
        if self.sees_everything(tenant):
            return None
        return tenant.credential if self.policy is TextPolicy.OWN else NO_CREDENTIAL

    def screen(self, tenant: Tenant, prompt_token_ids: Sequence[int], usage: Usage) -> None:
        """Withhold ``usage``'s miss reason's cached-side text when another credential wrote it
        (``usage.cache_reason`` replaced). Call before anything built from ``usage`` goes out:
        a streamed answer's start (Anthropic's ``message_start``) as well as its end."""
        r = usage.cache_reason
        if r is not None and r.cached_after and not self.sees_everything(tenant):
            usage.cache_reason = self._screened(tenant, list(prompt_token_ids), r)

    def note(self, tenant: Tenant, prompt_token_ids: Sequence[int], usage: Usage) -> None:
        """One finished request of ``tenant``: :meth:`screen` its usage, then record which blocks
        this credential's prompt held. Call before the answer is rendered."""
        ids = list(prompt_token_ids)
        self.screen(tenant, ids, usage)
        if self.policy is TextPolicy.OWN:
            try:
                keys = self.keys(tenant, ids)
            except Exception:  # no cache (switched off): nothing to record
                keys = []
            self.written.add(tenant.credential, keys)

    def _screened(self, tenant: Tenant, ids: list[int], r: CacheReason) -> CacheReason:
        if self.policy is TextPolicy.OWN and r.token_index is not None and r.cached_span:
            b = self.block_size
            start = r.token_index // b * b
            try:
                keys = self.keys(tenant, ids[:start] + list(r.cached_span))
            except Exception:
                keys = []
            if keys and self.written.wrote(tenant.credential, keys[-1]):
                # Shown: the cached side's tokens within the blocks this credential wrote.
                room = start + len(r.cached_span) // b * b - r.token_index
                return dataclasses.replace(r, cached_after=r.cached_after[: max(room, 0)])
        return dataclasses.replace(r, cached_after=(), cached_span=(), cached_hidden=True)

    def busting_report(self, tenant: Tenant, report: dict[str, Any]) -> dict[str, Any]:
        """``GET /v1/cache/report``'s body for ``tenant``: the findings' ``examples`` (text of
        the tenant's prompts, whoever sent them) only for a caller who sees everything or the
        only key of its tenant."""
        if self.sees_everything(tenant) or (self.policy is TextPolicy.OWN and tenant.name not in self.shared):
            return report
        for endpoint in report.get("endpoints", ()):
            for row in endpoint.get("busting", ()):
                row["examples"] = []
                row["examples_hidden"] = True
        return report
