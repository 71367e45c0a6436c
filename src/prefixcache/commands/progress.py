"""The progress bars of the analysis commands (audit, simulate, trace synth and import)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.progress import Progress


def progress() -> Progress:
    """A transient bar on stderr (none when stderr is not a terminal)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

    # On stderr, so that --json output on stdout stays clean. Redrawn twice a second, and not at
    # all when stderr is not a terminal: the redraw thread takes the GIL from the replay loop
    # (at 10 redraws a second a piped `simulate` of 10^5 requests took 40% longer).
    console = Console(stderr=True)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        transient=True,
        console=console,
        refresh_per_second=2,
        disable=not console.is_terminal,
    )


class Stages:
    """``progress(stage, done, total)`` callbacks drawn as one bar per stage (total 0: unknown)."""

    def __init__(self, prog: Progress) -> None:
        self.prog = prog
        self.tasks: dict[str, int] = {}

    def __call__(self, stage: str, done: float, total: float) -> None:
        task = self.tasks.get(stage)
        if task is None:
            task = self.tasks[stage] = self.prog.add_task(stage, total=total or None)
        self.prog.update(task, completed=done, total=total or None)
