"""``serve``'s secrets from its flags and environment: the API key map, the salt secret and the
Redis URL, each from one source, with a usage error that names the flag (and a warning where a
secret sits on the command line, which ``ps`` shows to every local user)."""

from __future__ import annotations

from pathlib import Path

import typer


def secrets_of(
    api_keys: Path | None, salt_secret: str | None, salt_secret_file: Path | None, *, salt_on_argv: bool
) -> tuple[dict[str, str] | None, str | None]:
    """The key map (``--api-keys`` file, else ``$PREFIXCACHE_API_KEYS``) and the salt secret
    (``--salt-secret-file``, else ``--salt-secret`` / ``$PREFIXCACHE_SALT_SECRET``). A secret
    given on the command line works, with a warning: ``ps`` shows argv to every local user."""
    import logging

    from prefixcache.server.auth import load_api_keys
    from prefixcache.server.exposure import MIN_REDACTED_LEN, api_keys_from_env, read_secret_file

    log = logging.getLogger("prefixcache.serve")
    try:
        keys = load_api_keys(api_keys) if api_keys else api_keys_from_env()
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--api-keys") from e
    if keys and any(len(k) < MIN_REDACTED_LEN for k in keys):
        log.warning("some API keys are shorter than %d characters: use long random keys", MIN_REDACTED_LEN)
    if salt_secret_file is not None:
        if salt_secret is not None:
            raise typer.BadParameter(
                "give the salt secret once: --salt-secret-file or --salt-secret ($PREFIXCACHE_SALT_SECRET)",
                param_hint="--salt-secret-file",
            )
        try:
            secret = read_secret_file(salt_secret_file, "salt secret")
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--salt-secret-file") from e
        check_length(secret, "--salt-secret-file")
        return keys, secret
    if salt_secret is not None:
        check_length(salt_secret, "--salt-secret ($PREFIXCACHE_SALT_SECRET)")
    if salt_secret and salt_on_argv:
        log.warning(
            "--salt-secret on the command line is visible to every local user (ps); "
            "use $PREFIXCACHE_SALT_SECRET or --salt-secret-file"
        )
    return keys, salt_secret


def check_length(secret: str, where: str) -> None:
    from prefixcache.server.exposure import weak_secret

    why = weak_secret(secret)
    if why is not None:
        raise typer.BadParameter(why, param_hint=where)


def redis_url_of(redis_url: str | None, redis_url_file: Path | None, *, on_argv: bool) -> str | None:
    """The Redis URL: ``--redis-url-file``, else ``--redis`` / ``$PREFIXCACHE_REDIS_URL``. A
    password given on the command line works, with a warning (``ps`` shows argv)."""
    import logging

    from prefixcache.server.exposure import read_secret_file, redis_password

    if redis_url_file is not None:
        if redis_url is not None:
            raise typer.BadParameter(
                "give the Redis URL once: --redis-url-file or --redis ($PREFIXCACHE_REDIS_URL)",
                param_hint="--redis-url-file",
            )
        try:
            return read_secret_file(redis_url_file, "Redis URL")
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint="--redis-url-file") from e
    if redis_url and on_argv and redis_password(redis_url):
        logging.getLogger("prefixcache.serve").warning(
            "--redis with a password on the command line is visible to every local user (ps); "
            "use $PREFIXCACHE_REDIS_URL or --redis-url-file"
        )
    return redis_url
