"""Who can reach the server, and keeping its secrets out of argv and logs.

* :func:`exposure_refusal`: ``prefixcache serve`` on a non-loopback address without API keys is
  refused unless the operator says ``--allow-unauthenticated``: besides free use of the model,
  every answer's ``cached_tokens`` tells the caller whether (and how much of) its prompt someone
  else sent before, which leaks other users' prompts one guess at a time.
* Secrets from a file or the environment instead of argv (where ``ps`` shows them to every local
  user): :func:`read_secret_file` (``--salt-secret-file``), :func:`api_keys_from_env`
  (``PREFIXCACHE_API_KEYS`` holds the key file's text).
* :class:`RedactSecrets`: a logging filter that writes ``***`` for every known secret (API
  keys, the salt secret, a Redis password) in a record's message and traceback;
  :func:`install_redaction` puts it on every handler there is.

What is not covered: a secret written to stdout/stderr without ``logging`` (``print``), and
secrets shorter than :data:`MIN_REDACTED_LEN`.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urlsplit

from prefixcache.server.auth import parse_api_keys

API_KEYS_ENV = "PREFIXCACHE_API_KEYS"
REDACTED = "***"
#: Shorter secrets are not redacted (replacing every "ab" in the logs would garble them); the
#: server warns about such keys instead.
MIN_REDACTED_LEN = 4


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) only accepts connections from this machine.
    Any other name counts as exposed: what it resolves to can change."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_refusal(host: str, has_keys: bool, allow_unauthenticated: bool) -> str | None:
    """Why serving on ``host`` is refused (None: it is not)."""
    if has_keys or allow_unauthenticated or is_loopback(host):
        return None
    return (
        f"Refusing to serve on {host} without API keys: anyone who can reach it could use the model, "
        "and the cached_tokens of every answer tell a caller whether, and how much of, its prompt "
        "someone else sent before (other users' prompts leak one guess at a time). Pass --api-keys FILE "
        f"(or {API_KEYS_ENV}), serve on 127.0.0.1, or pass --allow-unauthenticated if every client "
        "that can reach this address is trusted."
    )


#: The shortest salt secret accepted: one genuine tier entry lets a shorter one be guessed offline.
MIN_SALT_SECRET_BYTES = 16


def weak_secret(secret: str | bytes) -> str | None:
    """Why ``secret`` is too short to be the salt secret (None: it is long enough)."""
    n = len(secret.encode() if isinstance(secret, str) else secret)
    if n >= MIN_SALT_SECRET_BYTES:
        return None
    return (
        f"the salt secret is {n} bytes; give at least {MIN_SALT_SECRET_BYTES} random bytes "
        "(e.g. python -c 'import secrets; print(secrets.token_hex(32))')"
    )


def read_secret_file(path: str | os.PathLike[str], what: str) -> str:
    """The secret in ``path`` (surrounding whitespace and the final newline dropped). Raises
    ValueError naming ``what`` when it cannot be read or is empty."""
    p = Path(path)
    try:
        secret = p.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the {what} file {p}: {getattr(e, 'strerror', None) or e}") from e
    if not secret:
        raise ValueError(f"the {what} file {p} is empty")
    return secret


def api_keys_from_env(environ: dict[str, str] | None = None) -> dict[str, str] | None:
    """The key map in ``$PREFIXCACHE_API_KEYS`` (the key file's formats), or None when unset."""
    text = (os.environ if environ is None else environ).get(API_KEYS_ENV, "")
    return parse_api_keys(text, f"${API_KEYS_ENV}") if text.strip() else None


def redis_password(url: str | None) -> str | None:
    """The password in a ``redis://user:password@host`` URL, if any."""
    if not url:
        return None
    try:
        return urlsplit(url).password
    except ValueError:
        return None


class RedactSecrets(logging.Filter):
    """Replaces each secret with ``***`` in a record's message (arguments merged in) and in its
    traceback text. Never drops a record."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        # Longest first, so that a secret containing another is replaced whole.
        self.secrets = sorted({s for s in secrets if s and len(s) >= MIN_REDACTED_LEN}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.secrets:
            return True
        message = record.getMessage()
        redacted = self.redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = self.redact(record.exc_text)
        return True


def install_redaction(redactor: RedactSecrets) -> RedactSecrets:
    """Add ``redactor`` to every handler of the root logger and of every logger configured so
    far. Idempotent: call it again after a library (uvicorn) sets up its own handlers."""
    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    for lg in loggers:
        for handler in lg.handlers:
            if redactor not in handler.filters:
                handler.addFilter(redactor)
    return redactor
