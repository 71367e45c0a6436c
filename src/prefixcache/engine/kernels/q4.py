"""Quantized weights read in place (``pc_q4.c``): ``y = x @ W^T`` over the GGUF's groups of 32,
computed as the own GEMM computes the dequantized weights.

    lib = q4.load()                        # a Q4Kernel, or None (the native kernels are not built)
    y = lib.linear(x, qs, d, m)            # Q4_1: x [rows, K] float32/bfloat16 -> y [rows, N] x.dtype
    y = lib.linear8(x, q, d)               # Q8_0

Q4_1: ``qs`` uint8 ``[N, K/32, 16]`` (byte j: element j low nibble, element j + 16 high nibble,
the GGUF's order), ``d`` and ``m`` float16 ``[N, K/32]`` (``w = q * d + m``). Q8_0: ``q`` int8
``[N, K/32, 32]``, ``d`` float16 (``w = q * d``). Each output is bitwise what
:func:`prefixcache.engine.kernels.matmul.own_linear` gives on the dequantized weights (``dense``)
with the same GEMM ISA (``isa``: the own GEMM's for the dtype by default), so a row's bits do not
depend on the row count, its position or the thread count, and 4-bit decode rows are the float
model's. The AVX512, AVX2 and scalar paths (``path``) of the float32-lane arithmetic give the same
bits; bfloat16 on a CPU with a bf16 dot product has that one path.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from prefixcache.engine import kernels
from prefixcache.engine.kernels.matmul import ISAS, gemm_isa

#: ``PREFIXCACHE_KERNEL_ISA=avx2`` (or ``scalar``) forces that path of the 4-bit kernel (tests).
ISA_ENV = "PREFIXCACHE_KERNEL_ISA"
_PATHS = {"": 0, "auto": 0, "native": 0, "avx512": 0, "avx512bf16": 0, "amx": 0, "avx2": 1, "scalar": 2}


class Q4Kernel:
    """The 4-bit entry point of the loaded kernel library."""

    def __init__(self, native: kernels.NativeKernels) -> None:
        lib = native.lib
        i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.pc_q4_linear.argtypes = [i32, i32, i64, i64, i64, p, i64, p, p, p, p, i64, i32, i32]
        lib.pc_q4_linear.restype = i32
        lib.pc_q4_path.argtypes = [i32]
        lib.pc_q4_path.restype = ctypes.c_char_p
        lib.pc_q4_version.restype = i32
        lib.pc_q8_linear.argtypes = [i32, i32, i64, i64, i64, p, i64, p, p, p, i64, i32, i32]
        lib.pc_q8_linear.restype = i32
        self._fn = lib.pc_q4_linear
        self._fn8 = lib.pc_q8_linear
        self.version = int(lib.pc_q4_version())
        self.paths = {p: lib.pc_q4_path(p).decode() for p in (0, 1, 2)}
        #: What the cache namespace records (the kernel's version and the path compiled here).
        self.id = f"pcq4-v{self.version}-{self.paths[0]}"
        lib.pc_q4a8_linear.argtypes = [i32, i64, i64, i64, p, i64, p, p, p, p, i64, i32, i32]
        lib.pc_q4a8_linear.restype = i32
        lib.pc_q8a8_linear.argtypes = [i32, i64, i64, i64, p, i64, p, p, p, i64, i32, i32]
        lib.pc_q8a8_linear.restype = i32
        lib.pc_q4a8_version.restype = i32
        lib.pc_q4a8_path.argtypes = [i32]
        lib.pc_q4a8_path.restype = ctypes.c_char_p
        #: The tiles the 8-bit-row kernels run on each path (0 the best: ``avx512vnni`` where the
        #: CPU has AVX512-VNNI, else ``avx2``; 1 ``avx2``; 2 ``scalar``), all of the same bits.
        self.paths_a8 = {p: lib.pc_q4a8_path(p).decode() for p in (0, 1, 2)}
        self._fn_a8 = lib.pc_q4a8_linear
        self._fn8_a8 = lib.pc_q8a8_linear
        #: The 8-bit-activation kernels' arithmetic is one on every path (see pc_q4.c): their
        #: version alone names it.
        self.id_a8 = f"pcq4a8-v{int(lib.pc_q4a8_version())}"

    def linear(
        self,
        x: torch.Tensor,
        qs: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        isa: str | None = None,
        path: int | None = None,
    ) -> torch.Tensor:
        """Q4_1: ``x @ W^T`` as the own GEMM with ``isa`` computes it on the dequantized weights."""
        n, gk, _ = qs.shape
        if d.dtype != torch.float16 or m.dtype != torch.float16 or qs.dtype != torch.uint8:
            raise TypeError("pc_q4_linear takes uint8 nibbles and float16 scales and mins (see halves)")
        if not (qs.is_contiguous() and d.is_contiguous() and m.is_contiguous()) or d.shape != (n, gk):
            raise ValueError(
                f"4-bit weights: contiguous qs [N, K/32, 16], d and m [N, K/32]; got d {tuple(d.shape)}"
            )
        return self._call(self._fn, x, n, gk * 32, (qs, d, m), _isa_arg(isa, x.dtype), path)

    def linear8(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        d: torch.Tensor,
        isa: str | None = None,
        path: int | None = None,
    ) -> torch.Tensor:
        """Q8_0: ``x @ W^T`` for ``q`` int8 ``[N, K/32, 32]``, ``d`` float16 ``[N, K/32]``."""
        n, gk, _ = q.shape
        if d.dtype != torch.float16 or q.dtype != torch.int8 or d.shape != (n, gk):
            raise TypeError("pc_q8_linear takes int8 weights [N, K/32, 32] and float16 scales [N, K/32]")
        if not (q.is_contiguous() and d.is_contiguous()):
            raise ValueError("8-bit weights and scales must be contiguous")
        return self._call(self._fn8, x, n, gk * 32, (q, d), _isa_arg(isa, x.dtype), path)

    def linear_a8(
        self, x: torch.Tensor, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor, path: int | None = None
    ) -> torch.Tensor:
        """Q4_1 with 8-bit rows (``--weights q4a8``, pc_q4.c): ``qs`` uint8 ``[N, (K/32 + 1) // 2,
        32]`` in two-group records, the columns in quads (:func:`pack_pairs`), ``d`` and ``m``
        float16 ``[N, K/32]``."""
        n, gp, _ = qs.shape
        gk = d.shape[1] if d.dim() == 2 else -1
        if d.dtype != torch.float16 or m.dtype != torch.float16 or qs.dtype != torch.uint8:
            raise TypeError("pc_q4a8_linear takes uint8 records and float16 scales and mins")
        if not (qs.is_contiguous() and d.is_contiguous() and m.is_contiguous()) or (
            d.shape != (n, gk) or m.shape != (n, gk) or gp != (gk + 1) // 2
        ):
            raise ValueError(
                "4-bit records [N, (K/32 + 1) // 2, 32], d and m [N, K/32]; "
                f"got {tuple(qs.shape)}, {tuple(d.shape)}"
            )
        return self._call(self._fn_a8, x, n, gk * 32, (qs, d, m), (), path)

    def linear8_a8(
        self, x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, path: int | None = None
    ) -> torch.Tensor:
        """Q8_0 with 8-bit rows: ``q`` int8 ``[N, K/32, 32]``, the columns in quads
        (:func:`interleave_quads`), ``d`` float16 ``[N, K/32]``."""
        n, gk, _ = q.shape
        if d.dtype != torch.float16 or q.dtype != torch.int8 or d.shape != (n, gk):
            raise TypeError("pc_q8a8_linear takes int8 weights [N, K/32, 32] and float16 scales [N, K/32]")
        if not (q.is_contiguous() and d.is_contiguous()):
            raise ValueError("8-bit weights and scales must be contiguous")
        return self._call(self._fn8_a8, x, n, gk * 32, (q, d), (), path)

    def _call(
        self,
        fn: Any,
        x: torch.Tensor,
        n: int,
        k: int,
        weights: tuple[torch.Tensor, ...],
        lead: tuple[int, ...],
        path: int | None,
    ) -> torch.Tensor:
        """``fn`` on ``x``; ``lead``: the GEMM ISA's code for the exact kernels, () for the
        8-bit-row ones (one arithmetic on every ISA)."""
        if x.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"quantized products take float32 or bfloat16 rows; got {x.dtype}")
        xs = x.reshape(-1, k).contiguous()
        y = torch.empty(xs.shape[0], n, dtype=xs.dtype)
        if path is None:
            path = _PATHS.get(os.environ.get(ISA_ENV, "").strip().lower(), 0)
        rc = fn(
            int(xs.dtype == torch.bfloat16), *lead, xs.shape[0], n, k, xs.data_ptr(), k,
            *(w.data_ptr() for w in weights), y.data_ptr(), n, torch.get_num_threads(), path,
        )  # fmt: skip
        if rc == -3:
            raise MemoryError("the quantized kernel could not allocate its 8-bit rows")
        if rc != 0:
            raise kernels.KernelsUnavailableError(
                f"the quantized kernel has no {ISAS[lead[0]] if lead else 'such'} path in this build"
            )
        return y.reshape(*x.shape[:-1], n)


_isa: dict[torch.dtype, str] = {}


def _isa_arg(isa: str | None, dtype: torch.dtype) -> tuple[int]:
    """The exact kernels' leading GEMM ISA argument: ``isa``, else the own GEMM's for ``dtype``."""
    return (ISAS.index(isa if isa is not None else _default_isa(dtype)),)


def _default_isa(dtype: torch.dtype) -> str:
    """The own GEMM's ISA for ``dtype`` here (remembered: a call costs microseconds)."""
    if dtype not in _isa:
        _isa[dtype] = gemm_isa(dtype) or "generic"
    return _isa[dtype]


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


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """int 0..15 ``[N, K]`` -> uint8 ``[N, (K/32 + 1) // 2, 32]``, the 8-bit-row kernels' Q4_1
    records: byte i of record p holds element i of group 2p (low nibble) and of group 2p + 1 (high
    nibble; 0 past the last group), the columns in quads (:func:`interleave_quads`)."""
    n, k = q.shape
    gk = k // 32
    g = q.to(torch.uint8).view(n, gk, 32)
    if gk % 2:
        g = torch.cat([g, g.new_zeros(n, 1, 32)], 1)
    g = g.view(n, -1, 2, 32)
    return interleave_quads(g[:, :, 0] | (g[:, :, 1] << 4))


def interleave_quads(records: torch.Tensor) -> torch.Tensor:
    """``[N, R, 32]`` records (Q4_1's pairs, Q8_0's groups) -> the same shape with each whole quad
    of columns interleaved: record r of column 4j + c at quad j's start + (4 r + c) records; the
    last N mod 4 columns as they are (pc_q4.c: a tile of four columns then reads one sequential
    stream, which the hardware prefetcher keeps up with, instead of four at a column's stride)."""
    n, r, w = records.shape
    n4 = n // 4 * 4
    out = records.contiguous().clone()
    out[:n4] = records[:n4].reshape(n4 // 4, 4, r, w).transpose(1, 2).reshape(n4, r, w)
    return out


def halves(t: torch.Tensor) -> torch.Tensor:
    """A group's scales or mins as the kernel reads them: float16, which must hold them exactly
    (the GGUF stores them so; a value float16 cannot hold is refused, not rounded)."""
    h = t.to(torch.float16).contiguous()
    if not torch.equal(h.float(), t.float()):
        raise ValueError("4-bit group scales and mins must be float16 values (as a GGUF's Q4_1 stores them)")
    return h
