"""What an engine computes with: the runner chosen for a model (:func:`select_runner`, with
:func:`quantized_runner` for ``weights q4``), in one line for start-up logs and benchmark headers.

    describe_runtime(engine)  # "runner llama, dtype bfloat16 (this machine's default), weights bf16,
                              #  cpu, 2 threads, kernels: torch (...)"

The kernel set comes from ``prefixcache.engine.kernels.describe()`` where that package is built
into this install; without it the line says the torch ops are in use. :func:`off_this_thread`
runs the engine's set-up where it leaves no OpenMP thread pool behind (its docstring says why).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from prefixcache.engine.config import RUNNERS
from prefixcache.engine.llama import LlamaRunner, unsupported_reason
from prefixcache.engine.model import DTYPE_ENV, ModelRunner, default_dtype, machine_dtype

log = logging.getLogger(__name__)


T = TypeVar("T")


def off_this_thread(fn: Callable[[], T]) -> T:
    """``fn()`` on a short-lived thread (its result, or its exception re-raised here).

    The engine's compute runs on its worker thread. libgomp keeps a pool of OpenMP threads for
    every thread that ever ran a parallel region, and once the pools hold more threads than the
    machine has cores it stops spinning between regions (each region then waits for sleeping
    threads to wake): measured here, a decode step took 40 ms instead of 16 ms on the worker
    after the caller's thread had run one parallel torch op. Building the runner (weight
    conversion, the GEMM probes) and the KV pool on a thread that then exits leaves no pool
    behind; the caller's thread stays free of one unless it runs parallel work of its own."""
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # re-raised on the caller's thread
            err.append(exc)

    t = threading.Thread(target=run, name="prefixcache-build")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def select_runner(base: ModelRunner, runner: str = "auto", dtype: str | None = None) -> ModelRunner:
    """The runner an engine uses for ``base``: the own Llama runner where it can compute the
    model (``auto``, ``llama``), else (or with ``hf``) the Hugging Face one."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}; got {runner!r}")
    if isinstance(base, LlamaRunner):
        if runner == "hf":
            raise ValueError("runner='hf' needs a ModelRunner with its Hugging Face model, not a LlamaRunner")
        return LlamaRunner.from_model_runner(base, dtype=dtype)
    if runner == "hf":
        return base
    reason = unsupported_reason(base.config)
    if reason is None:
        return LlamaRunner.from_model_runner(base, dtype=dtype or default_dtype(base.device))
    if runner == "llama":
        raise ValueError(f"the own runner cannot compute this model ({reason}); use runner='hf' or 'auto'")
    log.info("using the Hugging Face runner: %s", reason)
    return base


def quantized_runner(base: ModelRunner, runner: ModelRunner, weights: str) -> ModelRunner:
    """``runner`` with ``weights``: ``float`` (as loaded), ``q4`` (the GGUF's Q4_1 groups read in
    place), ``q4a8`` (the same groups, decode and logits rows in 8 bits a group: another model
    numerically, opt-in), or ``auto`` (q4 where that computes the float model's bits: a GGUF with
    Q4_1 projections, the own runner on the CPU with the own quantized kernels and a GEMM ISA they
    reproduce; else float). Built once per (base, runner, format, q4 kernel): the kernel
    ``PREFIXCACHE_Q4`` picks is part of the key, since it changes the bits a step gives and the
    cache namespace."""
    from prefixcache.engine.quant import WEIGHT_FORMATS, q4_kernel_choice, quantize_runner

    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}; got {weights!r}")
    if getattr(runner, "weights_format", None) in ("q4_1", "q4_1a8"):
        return runner  # already 4-bit (an engine handed a prepared runner)
    if weights == "float" or (weights == "auto" and not _exact_q4_possible(base, runner)):
        return runner
    if not isinstance(runner, LlamaRunner):
        raise ValueError(
            f"--weights {weights} needs the own runner (a Llama-family model, runner auto or llama)"
        )
    a8 = weights == "q4a8"
    made = base.__dict__.setdefault("_q4_runners", {})
    key = (id(runner), runner.dtype_name, q4_kernel_choice(), a8)
    if key not in made:
        try:
            made[key] = quantize_runner(runner, getattr(base, "source_path", None), a8=a8)
        except ValueError as exc:
            made[key] = exc  # remembered: a later q4 says why, a later auto does not read again
    out = made[key]
    if isinstance(out, ValueError):
        if weights != "auto":
            raise out
        return runner  # auto: a GGUF without Q4_1 projections keeps its float weights
    if weights == "auto" and not getattr(out, "weights_exact", False):
        return runner
    return out


def _exact_q4_possible(base: ModelRunner, runner: ModelRunner) -> bool:
    """Whether ``auto`` may read 4-bit weights in place (see :func:`quantized_runner`)."""
    from prefixcache.engine.kernels import q4
    from prefixcache.engine.quant import q4_kernel_choice

    path = getattr(base, "source_path", None)
    return (
        isinstance(runner, LlamaRunner)
        and runner.device.type == "cpu"
        and runner.gemm.own not in ("", "amx")
        and path is not None
        and str(path).lower().endswith(".gguf")
        and q4_kernel_choice() != "torch"
        and q4.load() is not None
    )


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
