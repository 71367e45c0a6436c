"""The own 4-bit GEMM (``pc_q4.c``): ``y = x @ W^T`` over Q4_1 groups of 32, rows invariant.

    lib = q4.load()                        # a Q4Kernel, or None (torch's int4 kernel runs)
    y = lib.linear(x, qs, d, m)            # x [rows, K] float32/bfloat16 -> y [rows, N] x.dtype

``qs`` is uint8 ``[N, K/32, 16]`` (byte j: element j low nibble, element j + 16 high nibble, the
GGUF's order), ``d`` and ``m`` float32 ``[N, K/32]`` (``w = d * q + m``). Each output element is
reduced in one order that depends on K alone (see the C file), so a row's bits do not depend on
the row count, its position in the batch or the thread count; the AVX512, AVX2 and scalar paths
compute the same bits. Rows go in as float32 (bfloat16 widens exactly) and the float32 result is
rounded once to the input's dtype.
"""

from __future__ import annotations

import ctypes
import os

import torch

from prefixcache.engine import kernels

#: ``PREFIXCACHE_KERNEL_ISA=avx2`` (or ``scalar``) forces that path of the 4-bit kernel (tests).
ISA_ENV = "PREFIXCACHE_KERNEL_ISA"
_PATHS = {"": 0, "auto": 0, "native": 0, "avx512": 0, "avx512bf16": 0, "avx2": 1, "scalar": 2}


class Q4Kernel:
    """The 4-bit entry point of the loaded kernel library."""

    def __init__(self, native: kernels.NativeKernels) -> None:
        lib = native.lib
        i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.pc_q4_linear.argtypes = [i64, i64, i64, p, i64, p, p, p, p, i64, i32, i32]
        lib.pc_q4_linear.restype = None
        lib.pc_q4_path.argtypes = [i32]
        lib.pc_q4_path.restype = ctypes.c_char_p
        lib.pc_q4_version.restype = i32
        self._fn = lib.pc_q4_linear
        self.version = int(lib.pc_q4_version())
        self.paths = {p: lib.pc_q4_path(p).decode() for p in (0, 1, 2)}
        #: What the cache namespace records (the kernel's version and the path compiled here).
        self.id = f"pcq4-v{self.version}-{self.paths[0]}"

    def linear(
        self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, path: int | None = None
    ) -> torch.Tensor:
        n, gk, _ = qs.shape
        k = gk * 32
        xf = x.reshape(-1, k).to(torch.float32).contiguous()
        y = torch.empty(xf.shape[0], n, dtype=torch.float32)
        if path is None:
            path = _PATHS.get(os.environ.get(ISA_ENV, "").strip().lower(), 0)
        self._fn(
            xf.shape[0],
            n,
            k,
            xf.data_ptr(),
            k,
            qs.data_ptr(),
            d.data_ptr(),
            m.data_ptr(),
            y.data_ptr(),
            n,
            torch.get_num_threads(),
            path,
        )
        return y.to(x.dtype).reshape(*x.shape[:-1], n)


_cache: dict[int, Q4Kernel | None] = {}


def load() -> Q4Kernel | None:
    """The 4-bit kernel of the library :func:`prefixcache.engine.kernels.load` gives, or None."""
    native = kernels.load()
    if native is None:
        return None
    key = id(native)
    if key not in _cache:
        try:
            _cache[key] = Q4Kernel(native)
        except AttributeError:  # a library built without pc_q4.c
            _cache[key] = None
    return _cache[key]


def pack(q: torch.Tensor) -> torch.Tensor:
    """int 0..15 ``[N, K]`` -> uint8 ``[N, K/32, 16]`` in the GGUF's nibble order."""
    n, k = q.shape
    g = q.to(torch.uint8).view(n, k // 32, 32)
    return (g[..., :16] | (g[..., 16:] << 4)).contiguous()
