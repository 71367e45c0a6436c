"""Warm restarts on the command line: the disk tier's persisted salt secret for ``serve`` and
``cluster``, the start-up warning about unreadable namespaces, and ``prefixcache cache gc DIR``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from prefixcache.cache.tiers import DiskTier

log = logging.getLogger("prefixcache.serve")

cache_app = typer.Typer(
    name="cache",
    help="The disk tier's directory: what it holds and what no server can read any more.",
    no_args_is_help=True,
    rich_markup_mode="rich",
)


def disk_secret(disk_cache: Path | None, salt_secret: str | None, redis_url: str | None) -> str | None:
    """The salt secret ``serve`` uses: the one given (environment, file, argv), else with a disk
    tier the one persisted in its directory (created on first start), else None (random per
    process, with a warning when a shared Redis tier is on)."""
    if salt_secret is not None:
        return salt_secret
    if disk_cache is not None:
        from prefixcache.cache.tiers.persisted import SecretFileError, persisted_secret, secret_path

        try:
            secret, created = persisted_secret(disk_cache)
        except SecretFileError as e:
            raise typer.BadParameter(str(e), param_hint="--disk-cache") from e
        log.info(
            "salt secret: %s %s (a restart reads this disk tier; set $PREFIXCACHE_SALT_SECRET to share "
            "it across machines)",
            "created" if created else "read from",
            secret_path(disk_cache),
        )
        return secret
    if redis_url is not None:
        log.warning(
            "no salt secret given: a random one for this process, so no other replica and no restart "
            "can read what it writes to Redis; set $PREFIXCACHE_SALT_SECRET (the same for every replica)"
        )
    return None


def cluster_secret(disk_cache: Path | None) -> str:
    """The one secret of a cluster's replicas: with a disk tier the one persisted in its root
    directory (a restarted cluster is warm), else a random one for this run."""
    import secrets

    if disk_cache is None:
        return secrets.token_hex(32)
    from prefixcache.cache.tiers.persisted import SecretFileError, persisted_secret

    try:
        return persisted_secret(disk_cache)[0]
    except SecretFileError as e:
        raise typer.BadParameter(str(e), param_hint="--disk-cache") from e


def warn_stale(disk: DiskTier) -> None:
    """Log the namespaces of ``disk`` that its secret cannot read (earlier random secrets)."""
    from prefixcache.cache.tiers.persisted import stale_namespaces

    stale = stale_namespaces(disk.directory, disk.codec)
    if stale:
        log.warning(
            "disk tier %s: %d namespace directories (%d entries, %s) were written with another salt "
            "secret and can never be read; `prefixcache cache gc %s` reclaims them",
            disk.directory,
            len(stale),
            sum(n.entries for n in stale),
            human_bytes(sum(n.bytes for n in stale)),
            disk.directory,
        )


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@cache_app.command("gc")
def gc(
    directory: Annotated[Path, typer.Argument(help="The disk tier's directory (serve --disk-cache DIR).")],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="List what would be removed; remove nothing.")
    ] = False,
    salt_secret_file: Annotated[
        Path | None,
        typer.Option(
            "--salt-secret-file",
            envvar="PREFIXCACHE_SALT_SECRET_FILE",
            help="The servers' salt secret, when it is not the one kept in DIR/salt-secret "
            "(or set $PREFIXCACHE_SALT_SECRET).",
        ),
    ] = None,
) -> None:
    """Remove the namespace directories no server can read: those written with another salt secret
    (each restart of a server without a persisted or given secret left one). Stop servers that use
    another secret on DIR first: their namespaces look unreadable from here."""
    from prefixcache.cache.tiers.codec import TensorCodec
    from prefixcache.cache.tiers.persisted import (
        SecretFileError,
        read_persisted_secret,
        remove_namespaces,
        scan_namespaces,
    )
    from prefixcache.server.exposure import read_secret_file

    if not directory.is_dir():
        raise typer.BadParameter(f"no such directory: {directory}", param_hint="DIRECTORY")
    try:
        if salt_secret_file is not None:
            secret = read_secret_file(salt_secret_file, "salt secret")
        else:
            secret = os.environ.get("PREFIXCACHE_SALT_SECRET") or read_persisted_secret(directory)
    except (SecretFileError, ValueError) as e:
        raise typer.BadParameter(str(e), param_hint="--salt-secret-file") from e
    if not secret:
        raise typer.BadParameter(
            f"{directory} keeps no salt secret (no {directory}/salt-secret): give the servers' secret "
            "with --salt-secret-file or $PREFIXCACHE_SALT_SECRET",
            param_hint="DIRECTORY",
        )
    spaces = scan_namespaces(directory, TensorCodec.from_secret(secret))
    stale = [n for n in spaces if not n.readable]
    for n in spaces:
        state = "unreadable" if not n.readable else "readable"
        typer.echo(f"{n.tag}  {n.entries:>7,} entries  {human_bytes(n.bytes):>10}  {state}")
    if not stale:
        typer.echo(f"nothing to reclaim: {len(spaces)} namespace directories, all readable")
        return
    total = sum(n.bytes for n in stale)
    if dry_run:
        typer.echo(f"would remove {len(stale)} unreadable namespace directories ({human_bytes(total)})")
        return
    freed = remove_namespaces(directory, stale)
    typer.echo(f"removed {len(stale)} unreadable namespace directories ({human_bytes(freed)} freed)")


def register(app: typer.Typer) -> None:
    app.add_typer(cache_app)
