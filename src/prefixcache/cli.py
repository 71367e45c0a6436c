"""The `prefixcache` command line: one Typer app, one module of commands per layer.

Each module in :mod:`prefixcache.commands` defines ``register(app)``. Heavy imports (torch,
transformers, the server) happen inside the command functions, so ``--help`` stays instant.
"""

from __future__ import annotations

from typing import Annotated

import typer

from prefixcache.commands import analysis, cluster, engine, kv_events, server, warm

app = typer.Typer(
    name="prefixcache",
    help="An LLM inference engine, server and toolkit built around exact prompt (prefix) caching.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        from prefixcache import __version__

        typer.echo(f"prefixcache {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """An LLM inference engine, server and toolkit built around exact prompt (prefix) caching."""


for _module in (engine, server, analysis, cluster, warm, kv_events):
    _module.register(app)


#: Below this many columns (or off a terminal) help is click's plain text: rich's boxed panels
#: leave the help text a third of the width and cut environment variable names.
RICH_HELP_MIN_COLUMNS = 120


def _plain_help_when_narrow() -> None:
    import shutil
    import sys

    if sys.stdout.isatty() and shutil.get_terminal_size().columns >= RICH_HELP_MIN_COLUMNS:
        return
    app.rich_markup_mode = None
    for group in app.registered_groups:
        if group.typer_instance is not None:
            group.typer_instance.rich_markup_mode = None
            for sub in group.typer_instance.registered_groups:
                if sub.typer_instance is not None:
                    sub.typer_instance.rich_markup_mode = None


def main(argv: list[str] | None = None) -> None:
    """The console entry point: a usage error (a bad option, a missing file) is one line on
    stderr, ``prefixcache <command>: <what is wrong>``, with exit status 2; never a traceback."""
    import sys

    # typer carries its own copy of click: its exceptions are reached through typer's.
    usage_error = typer.BadParameter.__mro__[1]  # UsageError
    click_exception = typer.BadParameter.__mro__[2]  # ClickException

    _plain_help_when_narrow()
    try:
        code = app(args=argv, prog_name="prefixcache", standalone_mode=False)
    except usage_error as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "prefixcache"
        message = " ".join(exc.format_message().split())
        hint = f" (see '{where} --help')" if exc.ctx is not None else ""
        if message:  # (none after the help that a bare command prints)
            print(f"{where}: {message}{hint}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except click_exception as exc:
        print(f"prefixcache: {' '.join(exc.format_message().split())}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except typer.Abort:
        print("prefixcache: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":  # pragma: no cover
    main()
