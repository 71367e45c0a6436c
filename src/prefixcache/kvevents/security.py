"""Who may read a replica's KV events, and how the stream is protected.

What the stream reveals: every ``BlockStored`` carries the block's ``token_ids``, the prompt's
tokens, of every tenant (external routers such as vllm-router's ``kv_aware`` hash them
themselves, so they stay); anyone who can subscribe can decode every prompt the replica caches,
and a replay from sequence 0 hands over the buffered history. So:

* :func:`exposure_refusal`: the sockets bind to loopback (or ``ipc://`` / ``inproc://``) unless
  CURVE is on or the operator says ``--kv-events-allow-unauthenticated``, the same rule as
  ``serve``'s ``--host`` without API keys;
* CURVE (ZeroMQ's elliptic-curve authentication and encryption) between our publisher and our
  router: the publisher holds a secret key (:func:`read_secret_key`) and accepts only the client
  public keys it is given (a ZAP handler, :class:`CurveServer`); the router connects with its own
  secret key and the publisher's public key (:func:`client_options`). Key files hold Z85 text
  (40 characters); :func:`write_keypair` makes a pair (``prefixcache kv-keys``), secrets 0600.
"""

from __future__ import annotations

import ipaddress
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

Z85_KEY_LEN = 40


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://host:port`` endpoint (None for ipc:// and inproc://, which are local)."""
    if not endpoint.startswith("tcp://"):
        return None
    rest = endpoint[len("tcp://") :]
    if ";" in rest:  # tcp://source;host:port
        rest = rest.split(";", 1)[1]
    host, _, _ = rest.rpartition(":")
    return host.strip("[]")


def is_local(endpoint: str) -> bool:
    """Whether only this machine can connect to ``endpoint`` (loopback, ipc://, inproc://)."""
    host = endpoint_host(endpoint)
    if host is None:
        return True
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: reachable from elsewhere


def exposure_refusal(endpoints: Iterable[str | None], curve: bool, allow_unauthenticated: bool) -> str | None:
    """Why binding the KV event sockets on ``endpoints`` is refused (None: it is not)."""
    if curve or allow_unauthenticated:
        return None
    for endpoint in endpoints:
        if endpoint is not None and not is_local(endpoint):
            return (
                f"Refusing to publish KV events on {endpoint} without authentication: every BlockStored "
                "carries the prompt's token ids, so anyone who can connect reads every tenant's prompts. "
                "Bind to 127.0.0.1, give --kv-events-curve-secret-file and --kv-events-curve-clients, or "
                "pass --kv-events-allow-unauthenticated if every host that can reach it is trusted."
            )
    return None


def _read_key(path: str | os.PathLike[str], what: str) -> bytes:
    p = Path(path)
    try:
        text = p.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the {what} file {p}: {getattr(e, 'strerror', None) or e}") from e
    key = text.splitlines()[0].strip() if text else ""
    if len(key) != Z85_KEY_LEN:
        raise ValueError(
            f"{p}: a {what} is {Z85_KEY_LEN} characters of Z85 text (prefixcache kv-keys makes one)"
        )
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError) as e:
        raise ValueError(f"{p}: the {what} is not Z85 text (prefixcache kv-keys makes one)") from e
    return key.encode()


def read_secret_key(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a secret key file; ValueError when it is readable by the
    group or others (a secret), unreadable or malformed."""
    mode = Path(path).stat().st_mode if Path(path).exists() else 0
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{path} is readable by other users (mode {mode & 0o777:o}): chmod 600 it")
    secret = _read_key(path, "CURVE secret key")
    return zmq.curve_public(secret), secret


def read_public_keys(path: str | os.PathLike[str]) -> frozenset[bytes]:
    """The Z85 public keys of a file (one a line, ``#`` comments) or of every ``*.pub`` in a folder."""
    p = Path(path)
    files = sorted(p.glob("*.pub")) if p.is_dir() else [p]
    keys = set()
    for f in files:
        try:
            lines = f.read_text(encoding="ascii").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ValueError(f"cannot read the public key file {f}: {why}") from e
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if len(line) != Z85_KEY_LEN:
                raise ValueError(f"{f}:{n}: a CURVE public key is {Z85_KEY_LEN} characters of Z85 text")
            keys.add(line.encode())
    if not keys:
        raise ValueError(f"{p}: no CURVE public key found")
    return frozenset(keys)


def write_keypair(folder: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """A new CURVE key pair as ``folder/name.key`` (the secret, mode 0600) and ``name.pub``."""
    public, secret = zmq.curve_keypair()
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    key, pub = d / f"{name}.key", d / f"{name}.pub"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(secret.decode() + "\n")
    pub.write_text(public.decode() + "\n", encoding="ascii")
    return key, pub


class _Allowed:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return bytes(key) in self.keys


class CurveServer:
    """CURVE on a publisher's sockets: its secret key, and a ZAP handler on ``context`` that
    admits only ``clients`` (their Z85 public keys)."""

    def __init__(self, context: zmq.Context, secret: bytes, clients: frozenset[bytes]) -> None:
        self.public = zmq.curve_public(secret)
        self.secret = secret
        self._auth = ThreadAuthenticator(context)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=_Allowed(clients))

    def secure(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server (before it binds)."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)

    def close(self) -> None:
        self._auth.stop()


def client_options(server_public: bytes, secret: bytes) -> dict[int, bytes]:
    """Socket options of a CURVE client of the publisher whose public key is ``server_public``."""
    return {
        zmq.CURVE_SERVERKEY: server_public,
        zmq.CURVE_SECRETKEY: secret,
        zmq.CURVE_PUBLICKEY: zmq.curve_public(secret),
    }
