"""Keep-warm: a policy of prefixes every replica keeps pinned, re-asserted periodically.

Policy file (JSON, or YAML when PyYAML is installed)::

    {"interval_s": 60,
     "prefixes": [
       {"name": "support-bot", "api_key": "sk-tenant-a",
        "messages": [{"role": "system", "content": "You are the support assistant of ..."}]},
       {"name": "raw", "prompt": "Shared preamble ..."}
     ]}

Every ``interval_s`` the router sends each prefix to ``POST /v1/cache/pin`` on every healthy
replica, with the entry's ``api_key`` as the bearer credential (pins live in that tenant's
namespace). The replica prefills what is missing (from its tiers when another replica or a
previous run wrote it) and pins it: no expiry, no eviction. Re-sending is idempotent and brings a
restarted or recovered replica back in line. In the shared tier, a replica's pinned blocks have
their Redis expiry extended by :func:`prefixcache.cache.tiers.start_pin_refresher`.
The same is available ad hoc: ``POST /v1/cache/pin`` on the router goes to every replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only the reply's type; keep-warm never calls into the proxy itself
    from prefixcache.router.proxy import ReplicaReply

log = logging.getLogger(__name__)

#: ``send_to_all(method, path, body, headers)``: the request to every healthy replica, one reply
#: each (the router passes :meth:`prefixcache.router.proxy.Proxy.send_to_healthy`).
SendToAll = Callable[[str, str, bytes, dict[str, str]], Awaitable[Sequence["ReplicaReply"]]]


@dataclass(slots=True)
class WarmPrefix:
    name: str
    body: dict[str, Any]  # the pin request: exactly one of messages / prompt / prompt_token_ids
    api_key: str | None = None
    last_status: dict[str, int] = field(default_factory=dict)  # replica url -> HTTP status (0: down)


@dataclass(slots=True)
class KeepWarm:
    prefixes: list[WarmPrefix]
    interval_s: float = 60.0
    rounds: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KeepWarm:
        """Validate a policy. Raises ValueError saying which entry is wrong."""
        items = data.get("prefixes")
        if not isinstance(items, list):
            raise ValueError(
                "keep-warm policy: 'prefixes' must be a list of {messages|prompt|prompt_token_ids}"
            )
        out: list[WarmPrefix] = []
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise ValueError(f"keep-warm policy: prefixes[{i}] must be an object")
            body = {k: item[k] for k in ("messages", "prompt", "prompt_token_ids") if k in item}
            if len(body) != 1:
                raise ValueError(
                    f"keep-warm policy: prefixes[{i}] needs exactly one of messages, prompt, prompt_token_ids"
                )
            out.append(
                WarmPrefix(name=str(item.get("name", f"prefix-{i}")), body=body, api_key=item.get("api_key"))
            )
        interval = float(data.get("interval_s", 60.0))
        if interval <= 0:
            raise ValueError("keep-warm policy: interval_s must be > 0")
        return cls(prefixes=out, interval_s=interval)

    @classmethod
    def load(cls, path: str | Path) -> KeepWarm:
        """Read a policy file. Raises ValueError for a bad policy, and for a file that holds API
        keys and is readable by other users (as a secret must not be: chmod 600 it)."""
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            try:
                import yaml
            except ImportError as exc:  # pragma: no cover - PyYAML is usually present
                raise ValueError(
                    f"{path}: YAML needs PyYAML (pip install pyyaml), or write the policy as JSON"
                ) from exc
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a keep-warm policy is an object with 'prefixes'")
        policy = cls.from_dict(data)
        mode = Path(path).stat().st_mode & 0o777
        if mode & 0o077 and any(p.api_key for p in policy.prefixes):
            raise ValueError(
                f"{path} holds API keys and is readable by other users (mode {mode:o}): chmod 600 it"
            )
        return policy

    async def apply(self, send_to_all: SendToAll) -> int:
        """One round: pin every prefix on every healthy replica. Returns pins accepted."""
        accepted = 0
        for p in self.prefixes:
            headers = {"content-type": "application/json"}
            if p.api_key:
                headers["authorization"] = f"Bearer {p.api_key}"
            replies = await send_to_all("POST", "/v1/cache/pin", json.dumps(p.body).encode(), headers)
            for reply in replies:
                p.last_status[reply.url] = reply.status
                if 200 <= reply.status < 300:
                    accepted += 1
                else:
                    log.warning(
                        "keep-warm: pinning %r on %s failed: %s %s",
                        p.name,
                        reply.url,
                        reply.status,
                        str(reply.body)[:200],
                    )
        self.rounds += 1
        return accepted

    async def run(self, send_to_all: SendToAll) -> None:
        """:meth:`apply` every ``interval_s`` until cancelled; a failed round is logged, not fatal."""
        while True:
            try:
                await self.apply(send_to_all)
            except Exception:
                log.exception("keep-warm round failed")
            await asyncio.sleep(self.interval_s)
