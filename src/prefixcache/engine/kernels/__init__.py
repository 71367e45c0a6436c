"""The own CPU kernels (paged attention, RMSNorm + residual, RoPE + KV write, SwiGLU), or None.

    from prefixcache.engine import kernels
    k = kernels.load()           # a NativeKernels, or None (the torch path runs; reason logged once)
    kernels.describe()           # "native avx512bf16 (OpenMP, 2 threads)" or "torch (<reason>)"

``PREFIXCACHE_KERNELS`` chooses: ``auto`` (default: native where it builds, else torch with one
log line saying why), ``native`` (a build failure is an error), ``torch`` (never build or load).
The library is C with OpenMP, compiled here from ``pc_kernels.c`` at first use (see
:mod:`prefixcache.engine.kernels.build`) and called through ctypes with tensor data pointers.
Its id (``native-v<version>-<isa>-<source hash>``) goes into the cache namespace: blocks computed
by other arithmetic (the torch path, another ISA, another kernel version) never mix.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

from prefixcache.engine.kernels.build import BuildError, build, source_hash

log = logging.getLogger(__name__)

MODES = ("auto", "native", "torch")
ENV = "PREFIXCACHE_KERNELS"

_lock = threading.Lock()
_state: dict[str, Any] = {}  # mode -> (NativeKernels | None, reason); filled once per mode


class KernelsUnavailableError(RuntimeError):
    """``PREFIXCACHE_KERNELS=native`` (or kernels="native") and the kernels cannot be built/loaded."""


def mode() -> str:
    """The mode ``PREFIXCACHE_KERNELS`` asks for (``auto`` when unset)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"{ENV} must be one of {', '.join(MODES)}; got {value!r}")
    return value


class NativeKernels:
    """The loaded library: typed ctypes entry points (see pc_kernels.c for each contract)."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        i64, i32, f32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
        lib.pc_isa.restype = ctypes.c_char_p
        lib.pc_version.restype = i32
        lib.pc_openmp.restype = i32
        lib.pc_rms_residual.argtypes = [i32, i64, i64, p, p, p, f32, p, i32]
        lib.pc_rope_kv.argtypes = [i32, i64, i64, i64, i64, p, p, p, p, p, f32, p, p, p, i64, i32]
        lib.pc_swiglu.argtypes = [i32, i64, i64, p, p, i32]
        lib.pc_attention.argtypes = [i32, i64, i64, i64, p, p, p, i64, i64, i64, p, p, p, i32]
        for name in ("pc_rms_residual", "pc_rope_kv", "pc_swiglu", "pc_attention"):
            getattr(lib, name).restype = None
        # dt, isa, weight format, prompt rows, rows, dims, weights, norm, eps, scaling, x, h, pool,
        # blocks, B, pos, slots, cos, sin, segments, seg, tables, threads (pc_forward.c)
        layers: list[Any] = [
            i32,
            i32,
            i32,
            i32,
            i64,
            p,
            p,
            p,
            f32,
            f32,
            p,
            p,
            p,
            i64,
            i64,
            p,
            p,
            p,
            p,
            i64,
            p,
            p,
            i32,
        ]
        lib.pc_layers.argtypes = layers
        lib.pc_layers.restype = i32
        self.lib = lib
        self.path = path
        self.isa: str = lib.pc_isa().decode()
        self.version: int = int(lib.pc_version())
        self.openmp = bool(lib.pc_openmp())
        #: What the cache namespace records: kernel set, version, ISA, source.
        self.id = f"native-v{self.version}-{self.isa}-{source_hash()[:8]}"


def _load_native() -> NativeKernels:
    path = build()
    try:
        return NativeKernels(str(path))
    except (OSError, AttributeError) as exc:
        raise BuildError(f"cannot load {path.name}: {exc}") from exc


def resolve(requested: str | None = None) -> tuple[NativeKernels | None, str]:
    """(kernels or None, reason) for ``requested`` (``auto|native|torch``; None: the env var).
    Builds and loads at most once per process and mode; logs the torch fallback once."""
    want = mode() if requested is None else requested
    if want not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}; got {want!r}")
    with _lock:
        if want in _state:
            return _state[want]
        if want == "torch":
            asked = (
                f"{ENV}=torch" if os.environ.get(ENV, "").strip().lower() == "torch" else "kernels='torch'"
            )
            result: tuple[NativeKernels | None, str] = (
                None,
                asked,
            )
        else:
            try:
                k = _load_native()
                result = (k, k.id)
            except BuildError as exc:
                if want == "native":
                    raise KernelsUnavailableError(f"the native kernels cannot be used: {exc}") from exc
                result = (None, f"native kernels unavailable: {exc}")
                log.warning("prefixcache kernels: using the torch path (%s)", result[1])
        _state[want] = result
        return result


def load(requested: str | None = None) -> NativeKernels | None:
    """The native kernels, or None when the torch path runs (see :func:`resolve`)."""
    return resolve(requested)[0]


def describe(requested: str | None = None) -> str:
    """One line for start-up logs: ``native <isa> (OpenMP, N threads)`` or ``torch (<reason>)``."""
    import torch

    k, reason = resolve(requested)
    if k is None:
        return f"torch ({reason})"
    omp = "OpenMP" if k.openmp else "no OpenMP"
    return f"native {k.isa} ({omp}, {torch.get_num_threads()} threads; {k.id})"


__all__ = [
    "ENV",
    "MODES",
    "BuildError",
    "KernelsUnavailableError",
    "NativeKernels",
    "describe",
    "load",
    "mode",
    "resolve",
]
