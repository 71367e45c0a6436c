"""CLI commands of the engine layer (filled in by the work on that layer)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this layer's commands to the root app."""
