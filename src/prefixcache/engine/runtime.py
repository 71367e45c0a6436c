"""What an engine computes with, in one line for start-up logs and benchmark headers.

    describe_runtime(engine)  # "runner llama, dtype bfloat16 (this machine's default), weights bf16,
                              #  cpu, 2 threads, kernels: torch (...)"

The kernel set comes from ``prefixcache.engine.kernels.describe()`` where that package is built
into this install; without it the line says the torch ops are in use.
"""

from __future__ import annotations

import os
from typing import Any

from prefixcache.engine.model import DTYPE_ENV, machine_dtype


def kernels_line() -> str:
    """The kernel set in use: the kernels package's own description, else the torch ops."""
    try:
        from prefixcache.engine import kernels

        return str(kernels.describe())
    except ImportError:
        return "torch ops (no own kernels in this install)"
    except Exception as exc:  # a broken build must not stop a server from starting
        return f"torch ops (the own kernels failed to describe themselves: {exc})"


def dtype_source(dtype: str, device: Any = "cpu") -> str:
    """Why the engine computes in ``dtype``: the variable, the machine's default, or the caller."""
    env = os.environ.get(DTYPE_ENV, "").strip()
    if env and env == dtype:
        return f"${DTYPE_ENV}"
    if dtype == machine_dtype(device):
        return "this machine's default"
    return "set by the caller"


def describe_runtime(engine: Any) -> str:
    """One line: runner, dtype (and where it came from), weight format, threads, device, kernels."""
    runner = getattr(engine, "runner", None)
    if runner is None:  # an engine double without a runner (tests), or one not built yet
        return "runner unknown"
    kind = getattr(runner, "kind", None) or "hf"
    dtype = runner.dtype_name
    parts = [
        f"runner {kind}",
        f"dtype {dtype} ({dtype_source(dtype, runner.device)})",
        f"weights {getattr(runner, 'weights_format', dtype)}",
        f"cpu, {runner.threads} threads" if runner.device.type == "cpu" else f"device {runner.device}",
    ]
    line = ", ".join(parts)
    if kind == "llama":
        if getattr(runner, "native", None) is None and not kernels_line().startswith("torch"):
            # the kernels are built, but this runner does not use them (forced, dtype, device, shape)
            line += f", kernels: torch path ({getattr(runner, 'kernels', 'torch')})"
        else:
            line += f", kernels: {kernels_line()}"
    return line
