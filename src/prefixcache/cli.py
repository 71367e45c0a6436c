"""The `prefixcache` command line: one Typer app, one module of commands per layer.

Each module in :mod:`prefixcache.commands` defines ``register(app)``. Heavy imports (torch,
transformers, the server) happen inside the command functions, so ``--help`` stays instant.
"""

from __future__ import annotations

import typer

from prefixcache.commands import analysis, cluster, engine, kv_events, server

app = typer.Typer(
    name="prefixcache",
    help="An LLM inference engine, server and toolkit built around exact prompt (prefix) caching.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)

for _module in (engine, server, analysis, cluster, kv_events):
    _module.register(app)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
