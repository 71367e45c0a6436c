"""The own row-invariant GEMM (``pc_gemm.c``): ``own_linear(x, w, bias)`` == ``F.linear``'s product.

    from prefixcache.engine.kernels import matmul
    isa = matmul.gemm_isa(torch.bfloat16)        # "avx512bf16", "avx512", "avx2", or None
    y = matmul.own_linear(x, w, bias, isa=isa)   # x [M, K], w [N, K] (as torch keeps it), y [M, N]

Each output element is one fixed sequence of float32 operations that depends on ``K`` alone (16
lanes over ``K`` in ascending chunks, one fixed tree over the lanes, the bias, one rounding to
bf16), so every row count, row position and thread count gives a row the same bits (the C file's
header). Threads split the output columns only. The weights are read where torch keeps them
(``[N, K]`` row-major): no packed copy.

``own_linear(..., prompt=True)`` is the GEMM's second arithmetic, for prompt rows (float32; the
rule of ``engine/gemm.py`` says where it runs): each output one chain of FMAs over ``k`` in
ascending order, then the bias, computed in register tiles over a packed 16-column weight panel
(``pc_gemm_rows``); its AVX2 and generic paths give the same bits, and any row count gives a row
the same bits, but not those of the lanes order above.

``PREFIXCACHE_KERNEL_ISA`` (``auto`` | ``avx2`` | ``avx512`` | ``avx512bf16`` | ``amx``) caps the GEMM's
ISA, so the lower paths run (and are tested) on a CPU that has the higher ones; asking for one
this build or CPU lacks is an error naming what there is. The float32 paths of every ISA compute
the same bits; bfloat16 on ``avx512bf16`` uses the CPU's bf16 dot product, and on ``amx`` the
tile unit (Intel AMX-BF16: 16 x 16 outputs a tile product, any row count up to 16 at the cost of
one, so decode batches and prefill chunks run at the weights' read rate), each with its own bits
(the GEMM's tag, in the cache namespace, names the ISA per dtype). ``amx`` takes weights whose
inner size is a multiple of 32 and outer a multiple of 16; other shapes run the dot product.
"""

from __future__ import annotations

import ctypes
import os

import torch

from prefixcache.engine import kernels

#: ISA codes of pc_gemm.c, lowest first.
ISAS = ("generic", "avx2", "avx512", "avx512bf16", "amx")
ENV = "PREFIXCACHE_KERNEL_ISA"
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_bound: dict[int, ctypes.CDLL] = {}


class IsaUnavailableError(RuntimeError):
    """The GEMM ISA asked for (``PREFIXCACHE_KERNEL_ISA`` or ``isa=``) is not built or not run here."""


def _lib() -> ctypes.CDLL | None:
    """The kernels' library with the GEMM's entry points typed, or None (torch path: see kernels)."""
    k = kernels.load()
    if k is None:
        return None
    lib = k.lib
    if id(lib) not in _bound:
        i64, i32, p = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.pc_gemm.argtypes = [i32, i32, i64, i64, i64, p, i64, p, p, p, i64, i32]
        lib.pc_gemm.restype = i32
        lib.pc_gemm_rows.argtypes = [i32, i32, i64, i64, i64, p, i64, p, p, p, i64, i32]
        lib.pc_gemm_rows.restype = i32
        lib.pc_gemm_isas.restype = i32
        lib.pc_gemm_version.restype = i32
        _bound[id(lib)] = lib
    return lib


def version() -> int:
    lib = _lib()
    return 0 if lib is None else int(lib.pc_gemm_version())


def available() -> tuple[str, ...]:
    """The GEMM ISAs this build has and this CPU runs (empty: kernels not built)."""
    lib = _lib()
    if lib is None:
        return ()
    mask = int(lib.pc_gemm_isas())
    return tuple(name for i, name in enumerate(ISAS) if mask >> i & 1)


def requested() -> str:
    """``PREFIXCACHE_KERNEL_ISA``, checked (``auto`` when unset)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value != "auto" and value not in ISAS[1:]:
        raise ValueError(f"{ENV} must be one of auto, {', '.join(ISAS[1:])}; got {value!r}")
    return value


def gemm_isa(dtype: torch.dtype, want: str | None = None) -> str | None:
    """The ISA the own GEMM computes ``dtype`` with here (``want``: an ISA name or ``auto``;
    None: the environment). None when the kernels are not built, the dtype is not one the GEMM
    computes, or only the scalar path exists (the torch rule is faster there). Raises
    :class:`IsaUnavailableError` when ``want`` names an ISA this machine cannot run."""
    want = requested() if want is None else want
    have = available()
    if not have or dtype not in _DTYPES:
        return None
    if want == "auto":
        isa = have[-1]
    elif want in have:
        isa = want
    else:
        raise IsaUnavailableError(f"{ENV}={want}: this CPU and build run only {', '.join(have)}")
    if isa in ("avx512bf16", "amx") and dtype == torch.float32:
        isa = "avx512"  # float32 has no bf16 dot product or tiles: the AVX512 FMA path
    return None if isa == "generic" else isa


def own_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    isa: str | None = None,
    threads: int | None = None,
    out: torch.Tensor | None = None,
    prompt: bool = False,
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` by the own GEMM: ``x`` [M, K] and ``w`` [N, K] of one dtype (float32
    or bfloat16), ``out`` [M, N] (rows contiguous) written in place when given. ``isa`` None: the
    best this machine runs for the dtype (``generic`` is accepted here, for tests); ``threads``
    None: torch's thread count. ``prompt``: the prompt-rows arithmetic (float32 only; module doc)."""
    lib = _lib()
    if lib is None:
        raise kernels.KernelsUnavailableError("the own GEMM needs the native kernels (see kernels.resolve)")
    if x.dtype != w.dtype or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise TypeError(f"own_linear computes float32/bfloat16 on the CPU; got x {x.dtype}, w {w.dtype}")
    if prompt and x.dtype != torch.float32:
        raise TypeError(f"the prompt-rows GEMM computes float32 only; got {x.dtype}")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"own_linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply")
    name = isa or gemm_isa(x.dtype, "auto") or "generic"
    if name not in ISAS:
        raise ValueError(f"isa must be one of {', '.join(ISAS)}; got {name!r}")
    M, K = x.shape
    N = w.shape[0]
    if x.stride(1) != 1 or x.stride(0) < K:
        x = x.contiguous()
    w = w.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
        if bias.shape != (N,):
            raise ValueError(f"own_linear: bias {tuple(bias.shape)} for {N} outputs")
    if out is None:
        out = torch.empty(M, N, dtype=x.dtype)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"own_linear: out must be [{M}, {N}] {x.dtype} with contiguous rows")
    return bound(name, prompt)(x, w, bias, out, threads)


class BoundGemm:
    """:func:`own_linear`'s product for one ISA (and arithmetic: ``prompt``) with the library
    bound once, for the runner's hot path (121 products a SmolLM2 step): per call only the shapes
    are checked, the output allocated and the library called. The caller has checked the dtypes
    and the device."""

    def __init__(self, isa: str, prompt: bool = False) -> None:
        lib = _lib()
        if lib is None:
            raise kernels.KernelsUnavailableError(
                "the own GEMM needs the native kernels (see kernels.resolve)"
            )
        if isa not in available():
            raise IsaUnavailableError(f"the own GEMM has no {isa} path here (runs {', '.join(available())})")
        self.isa = isa
        self.prompt = prompt
        self._code = ISAS.index(isa)
        self._gemm = lib.pc_gemm_rows if prompt else lib.pc_gemm

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        if x.stride(1) != 1:
            x = x.contiguous()
        if not w.is_contiguous():
            w = w.contiguous()
        M, K = x.shape
        N = w.shape[0]
        if w.shape[1] != K:
            raise ValueError(f"own_linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not multiply")
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if out is None:
            out = torch.empty(M, N, dtype=x.dtype)
        rc = self._gemm(
            _DTYPES[x.dtype], self._code, M, N, K, x.data_ptr(), x.stride(0), w.data_ptr(),
            None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
            torch.get_num_threads() if threads is None else threads,
        )  # fmt: skip
        if rc == -2:
            raise TypeError(f"the prompt-rows GEMM computes float32 only; got {x.dtype}")
        if rc != 0:
            raise IsaUnavailableError(f"the own GEMM has no {self.isa} path here")
        return out


_BOUND: dict[tuple[str, bool], BoundGemm] = {}


def bound(isa: str, prompt: bool = False) -> BoundGemm:
    """The :class:`BoundGemm` of ``isa`` and arithmetic (made once per process)."""
    gemm = _BOUND.get((isa, prompt))
    if gemm is None:
        gemm = _BOUND[isa, prompt] = BoundGemm(isa, prompt)
    return gemm
