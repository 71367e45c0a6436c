"""API keys -> tenants, and each tenant's cache salt.

Key file (``--api-keys FILE``, or its text in ``$PREFIXCACHE_API_KEYS``), either JSON::

    {"sk-alpha-123": "alpha", "sk-beta-456": "beta"}

or one ``key: tenant`` per line (blank lines and ``#`` comments ignored)::

    # key: tenant
    sk-alpha-123: alpha
    sk-beta-456: beta

Several keys may map to one tenant (they share its cache). A request presents its key as
``Authorization: Bearer KEY`` (OpenAI clients) or ``x-api-key: KEY`` (Anthropic clients).
Without a key file every request is tenant ``default`` and keys are ignored.

An *admin* tenant (``--admin-tenant NAME``, a tenant of the key file) sees every tenant's prefixes
on the dashboard (``GET /v1/dashboard``); every other key sees its own tenant's only. Being admin
changes nothing else: its requests are cached under its own salt like any tenant's.

The salt mixed into every block key is ``HMAC-SHA256(server_secret, tenant)``. The secret is
random per process unless ``PREFIXCACHE_SALT_SECRET``, ``--salt-secret-file`` or ``--salt-secret``
(visible in ``ps``: avoid it) sets it (replicas sharing a cache tier must share the secret). The
salt never leaves the server.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prefixcache.keygate import find_key, presented_key
from prefixcache.server.errors import APIError

SALT_SECRET_ENV = "PREFIXCACHE_SALT_SECRET"
DEFAULT_TENANT = "default"


@dataclass(frozen=True, slots=True)
class Tenant:
    """The authenticated caller: a label for stats and the secret salt for its block keys."""

    name: str
    salt: bytes = field(repr=False)
    admin: bool = False  # sees every tenant's prefixes on the dashboard
    #: which API key of the tenant this is (a keyed digest, never the key; "" without keys): the
    #: caller whose own prompt text a miss reason or the dashboard may show back
    credential: str = ""


def load_api_keys(path: str | Path) -> dict[str, str]:
    """Read a key file (JSON object or ``key: tenant`` lines). Raises ValueError on a bad file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read the API key file {p}: {e.strerror or e}") from e
    return parse_api_keys(text, str(p))


def parse_api_keys(text: str, source: str) -> dict[str, str]:
    """Key map from a key file's text (JSON object or ``key: tenant`` lines); ``source`` names
    where it came from in errors. Errors never quote a key, not even in part."""
    stripped = text.strip()
    keys: dict[str, str] = {}
    if stripped.startswith("{"):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ValueError(
                f'{source}: invalid JSON ({e.msg} at line {e.lineno}); expected {{"key": "tenant"}}'
            ) from e
        if not isinstance(data, dict):
            raise ValueError(f'{source}: expected a JSON object {{"key": "tenant"}}')
        for n, (k, v) in enumerate(data.items(), 1):
            if not isinstance(v, str) or not v:
                raise ValueError(f"{source}: the tenant of key number {n} must be a non-empty string")
            keys[str(k)] = v
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, sep, tenant = line.partition(":")
            if not sep or not key.strip() or not tenant.strip():
                raise ValueError(f"{source}:{n}: expected 'key: tenant'")
            keys[key.strip()] = tenant.strip()
    if not keys:
        raise ValueError(f"{source}: no API keys found; expected a JSON object or 'key: tenant' lines")
    return keys


def resolve_secret(secret: str | bytes | None = None) -> bytes:
    """The salt secret: the argument, else ``$PREFIXCACHE_SALT_SECRET``, else 32 random bytes."""
    if secret is None:
        secret = os.environ.get(SALT_SECRET_ENV) or None
    if secret is None:
        return secrets.token_bytes(32)
    return secret.encode() if isinstance(secret, str) else bytes(secret)


class Authenticator:
    """Maps request headers to a :class:`Tenant`. Thread-safe (immutable after construction)."""

    def __init__(
        self,
        api_keys: Mapping[str, str] | None = None,
        secret: str | bytes | None = None,
        admin_tenants: Iterable[str] = (),
    ) -> None:
        """``admin_tenants``: tenants of ``api_keys`` whose keys see every tenant on the dashboard.
        Raises ValueError for an admin tenant without a key file or not in it."""
        self.api_keys = dict(api_keys) if api_keys else None
        self._secret = resolve_secret(secret)
        self._tenants: dict[str, Tenant] = {}
        names = set(self.api_keys.values()) if self.api_keys else {DEFAULT_TENANT}
        admins = set(admin_tenants)
        if admins and self.api_keys is None:
            raise ValueError(
                "an admin tenant needs API keys (--api-keys): without them every caller is one tenant"
            )
        unknown = sorted(admins - names)
        if unknown:
            raise ValueError(
                f"admin tenant {unknown[0]!r} has no key in the key file; "
                f"use one of: {', '.join(sorted(names))}"
            )
        for name in names:
            self._tenants[name] = Tenant(name, self.salt_for(name), admin=name in admins)
        self._callers = {
            key: dataclasses.replace(self._tenants[name], credential=self._credential(key))
            for key, name in (self.api_keys or {}).items()
        }

    def _credential(self, key: str) -> str:
        return hmac.new(self._secret, b"credential\x00" + key.encode(), hashlib.sha256).hexdigest()[:24]

    def salt_for(self, tenant: str) -> bytes:
        return hmac.new(self._secret, tenant.encode("utf-8"), hashlib.sha256).digest()

    def authenticate(self, authorization: str | None, x_api_key: str | None) -> Tenant:
        """The tenant of this request; raises a 401 :class:`APIError` when keys are on and it has none."""
        if self.api_keys is None:
            return self._tenants[DEFAULT_TENANT]
        key = presented_key(authorization, x_api_key)
        if not key:
            raise APIError(
                401,
                "Missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
                code="missing_api_key",
            )
        found = find_key(self.api_keys, key)
        if found is None:
            raise APIError(401, "Invalid API key: check the key you were given.", code="invalid_api_key")
        return self._callers[found]
