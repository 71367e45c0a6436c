"""4-bit weights (``--weights q4`` and ``q4a8``): the GGUF's own Q4_1 groups on the own 4-bit kernel.

    runner = quantize_runner(LlamaRunner.from_model_runner(base), base.source_path)          # q4
    runner = quantize_runner(LlamaRunner.from_model_runner(base), base.source_path, a8=True)  # q4a8

The embedded SmolLM2 GGUF stores every projection as Q4_1: groups of 32 input weights, each
``w = d * q + m`` with a 4-bit ``q`` and float16 ``d``, ``m``. Those groups are read from the file
(the ``gguf`` package). Decode rows (and so single-stream decode, which reads every weight once a
token) go through the own kernel (``kernels/pc_q4.c``), which reads the nibbles and float16 scales
as stored (a quarter of the bf16 bytes) and whose rows are invariant by construction at every row
count, so decode rows go in one call whatever their number, and a step of decode rows alone runs
the compiled layer loop. Prefill rows use the same 4-bit values dequantized once into the compute
dtype (a dense GEMM's cost barely grows with the rows), in the runner's fixed-shape pieces
(``engine/gemm.py``). The lm_head (Q8_0 in the file) is read in its groups the same way.

- ``q4``: the kernel makes each weight's float value in registers and runs the own GEMM's
  arithmetic on it, so a decode row's bits are the float weights' (``weights_exact``: the float
  runner's cache namespace; ``auto`` picks it wherever that holds).
- ``q4a8`` (opt-in): decode and logits rows are quantized to 8 bits a group of 32 and each group's
  dot product is integer arithmetic, as llama.cpp computes Q4_1 (``pc_q4a8_linear``). About half
  the exact kernel's time a weight at one row: faster single streams, but another model
  numerically, so its
  ``weights_id`` (and cache namespace) names it; it is exact in itself (rows invariant, a hit
  equals recomputing: prompt rows' KV comes from the dequantized weights either way).

Where the native kernels are not built (or ``PREFIXCACHE_Q4=torch``), torch's int4 kernel
(``torch.ops.aten._weight_int4pack_mm_for_cpu``, ``scale = d``, ``zero = m + 8 d``, rows invariant
for every count measured, in the runner's fixed-shape pieces) takes ``q4``'s decode rows, with a
log line saying so, in a namespace of its own; ``q4a8`` is then refused with what to use instead.
``benchmarks/bench_quality.py`` reports both formats' greedy agreement with the float weights and
the perplexity of each on ``benchmarks/data/quality.txt``.
"""

from __future__ import annotations

import copy
import ctypes
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from prefixcache.engine.kernels import q4 as q4_kernel

log = logging.getLogger(__name__)

WEIGHT_FORMATS = ("auto", "float", "q4", "q4a8")
#: The name the 4-bit format carries in ``weights_id`` (and so in the cache namespace).
Q4_TAG = "q4_1-int4pack"
GROUP = 32
#: ``PREFIXCACHE_Q4``: ``auto`` (the default: the own kernel, ``kernels/pc_q4.c``, where the native
#: kernels are built, else torch's int4 kernel), ``own`` (an error where it is not built) or
#: ``torch`` (torch's int4 kernel).
Q4_ENV = "PREFIXCACHE_Q4"
Q4_CHOICES = ("auto", "own", "torch")
_Q4_1 = 3  # GGMLQuantizationType.Q4_1
_Q8_0 = 8  # GGMLQuantizationType.Q8_0


class Q4Weight:
    """One weight ``[N, K]`` in 4 bits: the own kernel's (or torch's int4 kernel's) form for decode
    rows, the same values dequantized into ``dtype`` (``dense``) for prefill rows.
    ``linear(x, decode)`` is ``x @ W^T``. On the own kernel (``isa``: the runner's GEMM ISA) a
    decode row's bits are the own GEMM's on ``dense``, invariant at any row count (``any_rows``:
    decode rows go in one call); ``desc`` holds the kernel's pointers (nibbles, scales, mins; the
    compiled layer loop reads ``kernel_view()``, which adds ``dense``), None on torch's kernel."""

    def __init__(
        self,
        q: torch.Tensor,
        d: torch.Tensor,
        m: torch.Tensor,
        dtype: torch.dtype,
        isa: str | None = None,
        a8: bool = False,
    ) -> None:
        """``q``: int32 ``[N, K]`` in 0..15; ``d``, ``m``: float32 ``[N, K / 32]`` (float16 values).
        ``a8``: decode rows quantized to 8 bits a group (``--weights q4a8``; the own kernel only)."""
        n, k = q.shape
        self.shape = (n, k)
        full = q.float().view(n, k // GROUP, GROUP) * d[..., None] + m[..., None]
        self.dense = full.view(n, k).to(dtype).contiguous()
        self.own = own_kernel()
        if a8 and self.own is None:
            raise ValueError(A8_NEEDS_OWN)
        self.isa = isa
        self.a8 = a8
        self.any_rows = self.own is not None
        self.desc: ctypes.Array[ctypes.c_void_p] | None = None
        self._view: tuple[ctypes.Array[ctypes.c_void_p], torch.Tensor] | None = None
        if self.own is not None:
            self.qs = q4_kernel.pack_pairs(q) if a8 else q4_kernel.pack(q)
            self.d, self.m = q4_kernel.halves(d), q4_kernel.halves(m)
            self.desc = (ctypes.c_void_p * 3)(self.qs.data_ptr(), self.d.data_ptr(), self.m.data_ptr())
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
            zero = m + 8 * d
            self.scales_zeros = torch.stack([d.t(), zero.t()], -1).to(dtype).contiguous()  # [K/32, N, 2]

    def kernel_view(self) -> int:
        """The address of this weight's ``pc_q4w`` (nibbles, scales, mins, ``dense``) for the
        compiled layer loop (own kernel only). Rebuilt when ``dense`` is another tensor than at
        the last call: a runner's dense tensors are swapped for the float runner's ones of the
        same values after loading, and a view built before would point at freed memory."""
        assert self.desc is not None, "torch's int4 kernel has no pc_q4w view"
        if self._view is None or self._view[1] is not self.dense:
            # pc_forward.c's pc_q4w: nibbles, scales, mins, dense, and a8 (non-NULL: 8-bit rows)
            view = (ctypes.c_void_p * 5)(*self.desc, self.dense.data_ptr(), 1 if self.a8 else None)
            self._view = (view, self.dense)
        return ctypes.addressof(self._view[0])

    def linear(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        if not decode:
            return torch.nn.functional.linear(x, self.dense)
        if self.own is not None:
            if self.a8:
                return self.own.linear_a8(x, self.qs, self.d, self.m)
            return self.own.linear(x, self.qs, self.d, self.m, isa=self.isa)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.contiguous(), self.packed, GROUP, self.scales_zeros
        )


class Q8Weight:
    """The ``lm_head`` in 8 bits on the own kernel: the GGUF's Q8_0 groups (``w = q * d``, an int8
    ``q`` and a float16 ``d`` per 32 input weights), 1.06 bytes a weight against bf16's 2. Logits
    rows are always decode-class rows (``GemmRule.logits_rows``), bitwise the own GEMM's on
    ``dense`` (the same values in the compute dtype), which serves any other row."""

    def __init__(
        self,
        q: torch.Tensor,
        d: torch.Tensor,
        dtype: torch.dtype,
        own: q4_kernel.Q4Kernel,
        isa: str | None,
        a8: bool = False,
    ) -> None:
        """``q``: int8 ``[N, K / 32, 32]``; ``d``: float32 ``[N, K / 32]`` (float16 values).
        ``a8``: logits rows quantized to 8 bits a group (``--weights q4a8``)."""
        n, gk, _ = q.shape
        self.shape = (n, gk * 32)
        self.dense = (q.float() * d[..., None]).view(self.shape).to(dtype).contiguous()
        self.own, self.isa, self.a8 = own, isa, a8
        self.any_rows = True
        # the 8-bit-row kernel reads the groups with the columns in quads; the exact one, as they are
        self.q, self.d = (q4_kernel.interleave_quads(q) if a8 else q.contiguous()), q4_kernel.halves(d)

    def linear(self, x: torch.Tensor, decode: bool) -> torch.Tensor:
        if not decode:
            return torch.nn.functional.linear(x, self.dense)
        if self.a8:
            return self.own.linear8_a8(x, self.q, self.d)
        return self.own.linear8(x, self.q, self.d, isa=self.isa)


def q4_kernel_choice() -> str:
    """Which kernel ``PREFIXCACHE_Q4`` asks for decode rows: ``auto`` (the default), ``own`` or ``torch``."""
    want = os.environ.get(Q4_ENV, "auto").strip().lower() or "auto"
    if want not in Q4_CHOICES:
        raise ValueError(f"{Q4_ENV} must be one of {', '.join(Q4_CHOICES)}; got {want!r}")
    return want


_warned: set[str] = set()

A8_NEEDS_OWN = (
    "--weights q4a8 needs the own quantized kernels (kernels/pc_q4.c), which are not built here "
    "(see the log) or are off (PREFIXCACHE_Q4=torch); use --weights q4 or float"
)


def own_kernel() -> q4_kernel.Q4Kernel | None:
    """The own 4-bit kernel unless ``PREFIXCACHE_Q4=torch``, or None where it is not built (torch's
    int4 kernel runs, said once in the log); ``PREFIXCACHE_Q4=own`` without it is an error."""
    want = q4_kernel_choice()
    if want == "torch":
        return None
    own = q4_kernel.load()
    if own is None:
        if want == "own":
            raise ValueError(f"{Q4_ENV}=own: the native kernels are not built here (see the log)")
        if "fallback" not in _warned:
            _warned.add("fallback")
            log.warning("4-bit weights: the own kernel is not built here; torch's int4 kernel runs")
    return own


def read_q4_1(path: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every Q4_1 tensor of the GGUF at ``path``: name -> (q int32 [N, K], d, m float32 [N, K/32])."""
    return read_groups(path)[0]


def read_groups(
    path: Path,
) -> tuple[
    dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dict[str, tuple[torch.Tensor, torch.Tensor]]
]:
    """The GGUF's Q4_1 tensors (name -> q int32 [N, K], d, m float32 [N, K/32]) and Q8_0 tensors
    (name -> q int8 [N, K/32, 32], d float32 [N, K/32]), in one read of the file."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:  # pragma: no cover - a dependency of the project
        raise ValueError("--weights q4 needs the gguf package: pip install gguf") from exc
    q4: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    q8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in GGUFReader(str(path)).tensors:
        kind = int(t.tensor_type)
        if kind not in (_Q4_1, _Q8_0):
            continue
        raw = np.asarray(t.data, dtype=np.uint8)
        n = raw.shape[0]
        blocks = raw.reshape(n, -1, 20 if kind == _Q4_1 else 34)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        if kind == _Q8_0:
            q8[t.name] = (torch.from_numpy(blocks[..., 2:].copy().view(np.int8)), torch.from_numpy(d))
            continue
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, -1).astype(np.int32)
        q4[t.name] = (torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m))
    return q4, q8


def _unpermute(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row order of a q/k projection (rows only; groups are along K)."""
    n = x.shape[0]
    return x.reshape(heads, n // heads // 2, 2, *x.shape[1:]).transpose(1, 2).reshape(x.shape)


def quantize_runner(runner: Any, path: Path | None, a8: bool = False) -> Any:
    """A copy of ``runner`` (a LlamaRunner) whose projections are the GGUF's Q4_1 groups (``a8``:
    with decode and logits rows quantized to 8 bits a group, ``--weights q4a8``).

    Raises ``ValueError`` saying what to pass when the model has no Q4_1 projections, or, with
    ``a8``, when the own kernels are not built."""
    if runner.device.type != "cpu":
        raise ValueError("--weights q4 runs on the CPU (torch's int4 kernel for CPUs); drop it on CUDA")
    if path is None or not Path(path).is_file() or Path(path).suffix.lower() != ".gguf":
        raise ValueError("--weights q4 needs a GGUF model with Q4_1 weights (the embedded SmolLM2 is one)")
    if a8 and own_kernel() is None:
        raise ValueError(A8_NEEDS_OWN)
    tensors, eights = read_groups(Path(path))
    heads, kv_heads, dt = runner.num_heads, runner.num_kv_heads, runner.dtype
    # the own kernel computes what the runner's own GEMM computes; without one, torch's int4 kernel
    isa = runner.gemm.own or None
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    out = copy.copy(runner)
    out.layers = []
    for i, lw in enumerate(runner.layers):
        try:
            parts = {n: tensors[f"blk.{i}.{n}.weight"] for n in names}
        except KeyError as exc:
            raise ValueError(
                f"{Path(path).name} has no Q4_1 tensor {exc.args[0]}: --weights q4 needs Q4_1 projections"
            ) from None
        parts["attn_q"] = tuple(_unpermute(t, heads) for t in parts["attn_q"])  # type: ignore[assignment]
        parts["attn_k"] = tuple(_unpermute(t, kv_heads) for t in parts["attn_k"])  # type: ignore[assignment]

        def fused(*keys: str, parts: dict[str, Any] = parts) -> Q4Weight:
            q, d, m = (torch.cat([parts[k][j] for k in keys]) for j in range(3))
            return Q4Weight(q, d, m, dt, isa, a8)

        layer = dict(lw)
        layer["qkv"] = fused("attn_q", "attn_k", "attn_v")
        layer["o"] = fused("attn_output")
        layer["gu"] = fused("ffn_gate", "ffn_up")
        layer["down"] = fused("ffn_down")
        for name in ("qkv", "o", "gu", "down"):
            _check(layer[name], lw[name], f"layer {i} {name}")
            if lw[name] is not None and lw[name].dtype == dt and lw[name].is_contiguous():
                layer[name].dense = lw[name]  # the same values (checked): one copy in memory
        out.layers.append(layer)
    own = own_kernel()
    # blocks of different kernels never mix
    tag = Q4_TAG if own is None else (f"q4_1a8-{own.id_a8}" if a8 else f"q4_1-{own.id}")
    head = eights.get("output.weight") or eights.get("token_embd.weight")
    if (
        own is not None
        and head is not None
        and tuple(head[0].shape[:2]) == (out.vocab_size, out.hidden // 32)
    ):
        lm_head = Q8Weight(*head, dt, own, isa, a8)
        if torch.equal(lm_head.dense, runner.lm_head.to(dt)):  # the values the model loaded
            if runner.lm_head.dtype == dt:
                lm_head.dense = runner.lm_head
            out.lm_head = lm_head
            tag += "-q8_0a8head" if a8 else "-q8_0head"
    # On the own kernels (every GEMM ISA but AMX's tiles) a 4-bit runner computes its float twin's
    # bits, prompt rows' KV included: the same cache namespace, so the two share blocks and tiers.
    # With 8-bit rows (a8) it is another model numerically: its own namespace.
    out.weights_exact = own is not None and isa not in (None, "amx") and not a8
    out.weights_id = runner.weights_id if out.weights_exact else f"{runner.weights_id}+{tag}"
    out.weights_format = "q4_1a8" if a8 else "q4_1"
    out._own_runners = {}
    log.info(
        "4-bit weights: %d layers from %s's Q4_1 groups%s%s",
        len(out.layers),
        Path(path).name,
        ", lm_head in its Q8_0 groups" if "q8_0" in tag else "",
        ", decode rows in 8 bits a group (another model numerically: its own cache namespace)" if a8 else "",
    )
    return out


def _check(q4: Q4Weight, dense: torch.Tensor | None, what: str) -> None:
    """The dequantized groups must be exactly the float weights the model loaded from the same
    file: a wrong row order or nibble order would otherwise pass unnoticed."""
    if dense is None:
        return
    if q4.dense.shape != dense.shape or not torch.equal(q4.dense, dense.to(q4.dense.dtype)):
        raise ValueError(f"the GGUF's Q4_1 groups of {what} do not match the loaded weights")
