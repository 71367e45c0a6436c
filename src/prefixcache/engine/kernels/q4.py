"""The own 4-bit GEMM (``pc_q4.c``): ``y = x @ W^T`` over Q4_1 groups of 32, rows invariant.

    lib = q4.load()                        # a Q4Kernel, or None (torch's int4 kernel runs)
    y = lib.linear(x, qs, d, m)            # x [rows, K] float32/bfloat16 -> y [rows, N] x.dtype

``qs`` is uint8 ``[N, K/32, 16]`` (byte j: element j low nibble, element j + 16 high nibble, the
GGUF's order), ``d`` and ``m`` float16 ``[N, K/32]`` (``w = d * q + m``, the GGUF's own values).
Each row is quantized to 8 bits per group of 32 (scale ``max |x| / 127``, as llama.cpp's Q8_1
activations) and each output is the exact integer group dot products scaled and reduced in one
order that depends on K alone (see the C file), so a row's bits do not depend on the row count,
its position in the batch or the thread count; the AVX512 (VNNI or BW), AVX2 and scalar paths
compute the same bits. The result is float32, rounded once to the input's dtype.
"""

from __future__ import annotations

import ctypes
import os

import torch

from prefixcache.engine import kernels

#: ``PREFIXCACHE_KERNEL_ISA=avx2`` (or ``scalar``) forces that path of the 4-bit kernel (tests).
ISA_ENV = "PREFIXCACHE_KERNEL_ISA"
_PATHS = {"": 0, "auto": 0, "native": 0, "avx512": 0, "avx512bf16": 0, "amx": 0, "avx2": 1, "scalar": 2}


class Q4Kernel:
    """The 4-bit entry point of the loaded kernel library."""

    def __init__(self, native: kernels.NativeKernels) -> None:
        lib = native.lib
        i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.pc_q4_linear.argtypes = [i32, i64, i64, i64, p, i64, p, p, p, p, i64, i32, i32]
        lib.pc_q4_linear.restype = i32
        lib.pc_q4_path.argtypes = [i32]
        lib.pc_q4_path.restype = ctypes.c_char_p
        lib.pc_q4_version.restype = i32
        lib.pc_q8_linear.argtypes = [i32, i64, i64, i64, p, i64, p, p, p, i64, i32, i32]
        lib.pc_q8_linear.restype = i32
        self._fn = lib.pc_q4_linear
        self._fn8 = lib.pc_q8_linear
        self.version = int(lib.pc_q4_version())
        self.paths = {p: lib.pc_q4_path(p).decode() for p in (0, 1, 2)}
        #: What the cache namespace records (the kernel's version and the path compiled here).
        self.id = f"pcq4-v{self.version}-{self.paths[0]}"

    def linear(
        self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, path: int | None = None
    ) -> torch.Tensor:
        n, gk, _ = qs.shape
        k = gk * 32
        if d.dtype != torch.float16 or m.dtype != torch.float16 or qs.dtype != torch.uint8:
            raise TypeError("pc_q4_linear takes uint8 nibbles and float16 scales and mins (see halves)")
        if not (qs.is_contiguous() and d.is_contiguous() and m.is_contiguous()) or d.shape != (n, gk):
            raise ValueError(
                f"4-bit weights: contiguous qs [N, K/32, 16], d and m [N, K/32]; got d {tuple(d.shape)}"
            )
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        xs = x.reshape(-1, k).contiguous()
        y = torch.empty(xs.shape[0], n, dtype=xs.dtype)
        if path is None:
            path = _PATHS.get(os.environ.get(ISA_ENV, "").strip().lower(), 0)
        rc = self._fn(
            int(xs.dtype == torch.bfloat16),
            xs.shape[0],
            n,
            k,
            xs.data_ptr(),
            k,
            qs.data_ptr(),
            d.data_ptr(),
            m.data_ptr(),
            y.data_ptr(),
            n,
            torch.get_num_threads(),
            path,
        )
        if rc != 0:
            raise MemoryError("pc_q4_linear: no memory for the quantized rows")
        return y.reshape(*x.shape[:-1], n)

    def linear8(
        self, x: torch.Tensor, wq: torch.Tensor, d: torch.Tensor, path: int | None = None
    ) -> torch.Tensor:
        """``x @ W^T`` for Q8_0 weights: ``wq`` int8 ``[N, K/32, 32]``, ``d`` float16 ``[N, K/32]``
        (``w = d * q``); the rows quantized as :meth:`linear` quantizes them."""
        n, gk, _ = wq.shape
        k = gk * 32
        if d.dtype != torch.float16 or wq.dtype != torch.int8 or d.shape != (n, gk):
            raise TypeError("pc_q8_linear takes int8 weights [N, K/32, 32] and float16 scales [N, K/32]")
        if not (wq.is_contiguous() and d.is_contiguous()):
            raise ValueError("8-bit weights and scales must be contiguous")
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        xs = x.reshape(-1, k).contiguous()
        y = torch.empty(xs.shape[0], n, dtype=xs.dtype)
        if path is None:
            path = _PATHS.get(os.environ.get(ISA_ENV, "").strip().lower(), 0)
        rc = self._fn8(
            int(xs.dtype == torch.bfloat16), xs.shape[0], n, k, xs.data_ptr(), k, wq.data_ptr(),
            d.data_ptr(), y.data_ptr(), n, torch.get_num_threads(), path,
        )  # fmt: skip
        if rc != 0:
            raise MemoryError("pc_q8_linear: no memory for the quantized rows")
        return y.reshape(*x.shape[:-1], n)


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


def halves(t: torch.Tensor) -> torch.Tensor:
    """A group's scales or mins as the kernel reads them: float16, which must hold them exactly
    (the GGUF stores them so; a value float16 cannot hold is refused, not rounded)."""
    h = t.to(torch.float16).contiguous()
    if not torch.equal(h.float(), t.float()):
        raise ValueError("4-bit group scales and mins must be float16 values (as a GGUF's Q4_1 stores them)")
    return h
