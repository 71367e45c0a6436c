"""SIGTERM as a clean stop for the long-running commands (``serve``, ``route``, ``cluster``).

uvicorn handles SIGTERM with a graceful shutdown and then raises the signal again so that the
process reports it. With Python's default handler that second delivery kills the process on the
spot: the command's ``finally`` never runs (``cluster`` would leave its replicas and Redis
running; ``serve`` would not flush its tier writes). :func:`sigterm_as_interrupt` makes SIGTERM
raise :class:`KeyboardInterrupt` in the main thread instead, the path Ctrl-C already takes: the
``finally`` blocks run and the command exits 0.
"""

from __future__ import annotations

import signal
from types import FrameType


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def sigterm_as_interrupt() -> None:
    """From now on SIGTERM raises KeyboardInterrupt in the main thread (call from it)."""
    signal.signal(signal.SIGTERM, _interrupt)
