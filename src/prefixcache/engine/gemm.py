"""Row-invariant GEMMs: every weight product of the own runner goes through :meth:`GemmRule.linear`.

    rule = gemm_rule(torch.bfloat16, torch.device("cpu"))
    rows = rule.rows(segments)                     # the step's row classes, once per step
    y = rule.linear(x, weight, bias, rows)         # == F.linear's math, row-invariant bits

A row's bits must not depend on how many rows share its GEMM or where it sits among them. torch's
CPU GEMMs pick their kernel (and so the reduction order) from the row count ``M``; measured on
torch 2.13 (``benchmarks/gemm_invariance.py`` reprints the table; ``tests/engine/test_gemm.py``
re-checks every rule the runner uses):

- bfloat16, AVX512-BF16 (oneDNN): every ``M`` from 1 to 32 gives the rows of the one-row
  product; from 33 rows on other kernels take over, and ``M`` = 48, 64, 100, 128, 256 and 512
  each differ somewhere from the one-row product and from each other (by one bf16 ulp).
- float32, AVX512 (MKL): ``M`` = 1-15 differ from a 1,024-row product, and with 2 threads so do
  64, 100 and 128; on AVX2 machines ``M`` = 4, 8 and every ``M`` >= 12 agreed.
- A fixed ``M`` gives the same bits for a row wherever it sits among the ``M`` rows (checked at
  offsets), for every ``M`` tried.

So rows are computed in **pieces of fixed shape** per row class: decode rows (and the logits
rows) in pieces of at most ``decode_piece`` rows, unpadded where every count up to that is
invariant (bfloat16, where a probe of the model's weight shapes on this machine and thread count
confirms it at start-up) or padded to exactly ``decode_piece`` (float32, and bfloat16
elsewhere); prefill rows in pieces of exactly ``prefill_piece`` rows (the last padded with zero
rows). Prefill rows and decode rows never share a piece, and each class always uses its own
shapes, so a prompt row has the same bits in a one-row tail as in a 512-row chunk, and a decode
row the same bits alone as in a batch of 16. On CUDA the rule is the previous one (one GEMM over
a multiple of 4 rows); :meth:`GemmRule.tag` names the rule in the cache namespace, so engines
with different rules never share blocks.

**The own rule** (``own`` set: the default on the CPU wherever the native kernels are built and
an AVX2/AVX512 GEMM path runs): dense weight products go through the engine's own GEMM
(``kernels/pc_gemm.c``, :func:`prefixcache.engine.kernels.matmul.own_linear`), whose every output
is one fixed sequence of operations depending on ``K`` alone: decode rows run unpadded, any
count in one call, invariant by construction; prefill rows run there too where ``own_prefill``
(measured faster than torch's 128-row pieces for the dtype, ``benchmarks/gemm_own.py``), else in
torch's 128-row pieces as before. Where ``prompt_rows`` (float32 on AVX2 and AVX512) prefill rows take the
own GEMM's second arithmetic (one FMA chain per output, ``own_linear(prompt=True)``), decode rows
the lanes order: each class invariant on its own, like the two attention paths. The tag names the
rule, the GEMM version and ISA and the prefill rows' path (``gemm-own-v1-avx2-prows-d16p``).
``PREFIXCACHE_KERNELS=torch`` (or kernels not built) keeps the torch rule above, which stays the
numerical reference.

Weights may be dense tensors or :class:`prefixcache.engine.quant.Q4Weight` (4-bit, see that
module): on the own quantized kernels (``any_rows``) decode rows go in one call at any count
(bitwise the own GEMM's rows on the dequantized weights) and prefill rows follow this rule on the
dequantized weights, so such a runner computes what a runner with those dense weights computes;
on torch's int4 kernel both go through the torch pieces.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

#: Rows of a prefill piece on the CPU: large enough for the big-M kernels' throughput, small
#: enough that a short tail (a 64-token question after a cached system prompt) wastes little.
PREFILL_PIECE = 128
#: The largest row count for which bfloat16 GEMM rows equal the one-row product (measured).
BF16_DECODE_PIECE = 32
#: float32 decode rows: padded to exactly this many (invariant on AVX2 and AVX512 machines).
F32_DECODE_PIECE = 16
#: The own GEMM's ISAs, per dtype, on which it computes prefill rows at least as fast as torch's
#: 128-row pieces (measured with ``benchmarks/gemm_own.py``); elsewhere torch keeps prefill rows.
#: bfloat16: the ISAs with a bf16 dot product (on the 2-core AMD EPYC with AVX512-BF16,
#: 2026-12-04, 128 and 512 rows at 1.01x and 1.02x torch's time, which lets those steps run the
#: compiled layer loop; AMX's tiles are faster still); emulated bf16 stays on torch. float32: the
#: AVX2 and AVX512 paths, through the prompt-rows arithmetic (``PROMPT_ROWS_ISAS``).
OWN_PREFILL_ISAS = {"float32": ("avx2", "avx512", "avx512bf16", "amx"), "bfloat16": ("avx512bf16", "amx")}
#: Where prefill rows take the own GEMM's second arithmetic (``pc_gemm_rows``: one FMA chain per
#: output over a packed weight panel) instead of its lanes order, which decode rows keep: float32
#: on AVX2, where the lanes tiles ran one layer's four products at 512 rows in 61 ms against
#: torch's 25 ms in 128-row pieces, and the prompt-rows tiles take about 0.75x torch's time at 512
#: rows and 0.2x at a 32-row tail (a 2-core AMD EPYC, Zen 3, 2026-12-07; docs/engine.md); and
#: float32 on AVX512 (also where the CPU has bf16, whose float32 products are the AVX512 path),
#: where its 512-bit tiles took 12.7 ms at 512 rows against the lanes tiles' 24-39 ms and torch's
#: 17-24 ms in 128-row pieces (a 2-core Ice Lake Xeon, 2026-12-08; docs/engine.md).
PROMPT_ROWS_ISAS = {"float32": ("avx2", "avx512"), "bfloat16": ()}


@dataclass(frozen=True, slots=True)
class Rows:
    """A step's row layout: ``runs`` of consecutive rows of one class, ``(start, stop, decode)``."""

    total: int
    runs: tuple[tuple[int, int, bool], ...]


@dataclass(frozen=True, slots=True)
class GemmRule:
    """How the runner computes a weight product so that rows stay invariant (module doc)."""

    prefill_piece: int
    decode_piece: int
    pad_decode: bool
    legacy: bool = False  # CUDA: one GEMM over a multiple of 4 rows
    own: str = ""  # the own GEMM's ISA ("" : the torch rule)
    own_prefill: bool = False  # prefill rows through the own GEMM too (else torch pieces)
    own_version: int = 0
    prompt_rows: bool = False  # prefill rows through the own GEMM's prompt-rows arithmetic

    def tag(self) -> str:
        """The rule's part of the cache namespace."""
        if self.legacy:
            return "gemm-pad4"
        pieces = f"p{self.prefill_piece}-d{self.decode_piece}{'p' if self.pad_decode else ''}"
        if self.own:
            prefill = (
                ("prows" if self.prompt_rows else "pown") if self.own_prefill else f"p{self.prefill_piece}"
            )
            rest = f"d{self.decode_piece}{'p' if self.pad_decode else ''}"
            return f"gemm-own-v{self.own_version}-{self.own}-{prefill}-{rest}"
        return f"gemm-{pieces}"

    def padded(self, n: int) -> int:
        """Rows the step's activations have for ``n`` real rows."""
        return max(4, (n + 3) // 4 * 4) if self.legacy else n

    def rows(self, segments: Sequence[Any], total: int | None = None) -> Rows:
        """The layout of a step's rows: segments in order, each decode or prefill; the rows past
        the real ones (the legacy rule's padding) join the last run."""
        runs: list[tuple[int, int, bool]] = []
        at = 0
        for seg in segments:
            n = len(seg.tokens)
            if runs and runs[-1][2] == bool(seg.decode):
                runs[-1] = (runs[-1][0], at + n, runs[-1][2])
            else:
                runs.append((at, at + n, bool(seg.decode)))
            at += n
        total = at if total is None else total
        if runs and total > at:
            runs[-1] = (runs[-1][0], total, runs[-1][2])
        return Rows(total, tuple(runs))

    def logits_rows(self, n: int) -> Rows:
        """The layout of ``n`` logits rows (the last row of each segment): decode-class pieces."""
        return Rows(n, ((0, n, True),))

    def linear(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None, rows: Rows) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` for ``x`` of ``rows.total`` rows, in fixed-shape pieces
        (or through the own GEMM: module doc)."""
        if (
            self.own
            and isinstance(weight, torch.Tensor)
            and weight.dtype == x.dtype
            and x.device.type == "cpu"
            and (self.own_prefill or any(decode for _, _, decode in rows.runs))
        ):  # prefill rows alone on torch's pieces take the path below, as under the torch rule
            return self._own_linear(x, weight, bias, rows)
        if getattr(weight, "any_rows", False):
            return self._quantized(x, weight, bias, rows)
        own = getattr(weight, "linear", None)
        if own is None:

            def mm(a: torch.Tensor, decode: bool) -> torch.Tensor:
                return F.linear(a, weight, bias)

        else:
            mm = own if bias is None else (lambda a, decode: own(a, decode) + bias)
        if self.legacy:
            return mm(x, bool(rows.runs) and rows.runs[0][2])
        if len(rows.runs) == 1 and self._whole(rows.runs[0]):
            return mm(x, rows.runs[0][2])
        outs = []
        for start, stop, decode in rows.runs:
            outs.extend(self._pieces(x, start, stop, decode, mm))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _quantized(self, x: torch.Tensor, weight: Any, bias: torch.Tensor | None, rows: Rows) -> torch.Tensor:
        """A weight on the own quantized kernels (``any_rows``): decode rows in one call whatever
        their count, prefill rows by this rule on the same values dequantized (``weight.dense``),
        as a runner with those dense weights computes them."""
        outs = []
        for start, stop, decode in rows.runs:
            part = x[start:stop]
            if decode:
                y = weight.linear(part, True)
                outs.append(y if bias is None else y + bias)
            else:
                outs.append(
                    self.linear(part, weight.dense, bias, Rows(stop - start, ((0, stop - start, False),)))
                )
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _own_linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows: Rows
    ) -> torch.Tensor:
        from prefixcache.engine.kernels.matmul import bound

        gemm = bound(self.own)
        if (self.own_prefill and not self.prompt_rows) or all(decode for _, _, decode in rows.runs):
            return gemm(x, weight, bias)
        prompt = bound(self.own, True) if self.prompt_rows else None
        if prompt is not None and not any(decode for _, _, decode in rows.runs):
            return prompt(x, weight, bias)
        out = x.new_empty(x.shape[0], weight.shape[0])
        for start, stop, decode in rows.runs:
            if decode:
                gemm(x[start:stop], weight, bias, out[start:stop])
            elif prompt is not None:
                prompt(x[start:stop], weight, bias, out[start:stop])
            else:
                mm = lambda a, decode: F.linear(a, weight, bias)  # noqa: E731
                parts = self._pieces(x, start, stop, False, mm)
                out[start:stop] = parts[0] if len(parts) == 1 else torch.cat(parts)
        return out

    # ------------------------------------------------------------------ pieces
    def _whole(self, run: tuple[int, int, bool]) -> bool:
        """Whether one call over the run already has a piece's shape."""
        start, stop, decode = run
        n = stop - start
        if decode:
            return n <= self.decode_piece and (not self.pad_decode or n == self.decode_piece)
        return n == self.prefill_piece

    def _pieces(self, x: torch.Tensor, start: int, stop: int, decode: bool, mm: Any) -> list[torch.Tensor]:
        size = self.decode_piece if decode else self.prefill_piece
        pad = self.pad_decode if decode else True
        outs = []
        for a in range(start, stop, size):
            b = min(a + size, stop)
            part = x[a:b]
            if pad and b - a < size:
                part = torch.cat([part, part.new_zeros(size - (b - a), part.shape[1])])
                outs.append(mm(part, decode)[: b - a])
            else:
                outs.append(mm(part, decode))
        return outs


_CHECKED: dict[tuple[int, int, int], bool] = {}


def unpadded_rows_invariant(shape: tuple[int, int], dtype: torch.dtype, upto: int) -> bool:
    """Whether, on this machine and thread count, every row count 1..``upto`` of ``F.linear``
    with a weight of ``shape`` gives the rows of the one-row product (a seeded random probe,
    remembered per shape and thread count)."""
    key = (*shape, torch.get_num_threads())
    if key not in _CHECKED:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(*shape, generator=gen).to(dtype)
        x = torch.randn(upto, shape[1], generator=gen).to(dtype)
        one = torch.cat([F.linear(x[i : i + 1], w) for i in range(upto)])
        _CHECKED[key] = all(torch.equal(F.linear(x[:m], w), one[:m]) for m in range(2, upto + 1))
    return _CHECKED[key]


def own_gemm(dtype: torch.dtype, kernels: str | None = None) -> tuple[str, bool, int]:
    """(ISA, prefill rows too, version) of the own GEMM for ``dtype`` under ``kernels``
    (auto|native|torch; None: ``PREFIXCACHE_KERNELS``), or ("", False, 0): the torch rule."""
    from prefixcache.engine import kernels as native
    from prefixcache.engine.kernels import matmul

    if native.load(kernels) is None:
        return "", False, 0
    isa = matmul.gemm_isa(dtype) if dtype in (torch.float32, torch.bfloat16) else None
    if isa is None:
        return "", False, 0
    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    prefill = isa in OWN_PREFILL_ISAS[name]
    return isa, prefill, matmul.version()


def gemm_rule(
    dtype: torch.dtype,
    device: torch.device,
    shapes: Sequence[tuple[int, int]] = (),
    kernels: str | None = None,
) -> GemmRule:
    """The rule for a runner computing in ``dtype`` on ``device`` (module doc). ``shapes``: the
    weights' ``(out, in)`` shapes; bfloat16 decode rows go unpadded only where this machine's
    kernels are checked to be invariant at every count up to the piece for each of them (else
    they are padded, like float32's, and the tag says so). ``kernels`` (auto|native|torch, None:
    ``PREFIXCACHE_KERNELS``): the own GEMM is used where the native kernels load."""
    if device.type != "cpu":
        return GemmRule(prefill_piece=0, decode_piece=0, pad_decode=True, legacy=True)
    own, own_prefill, version = own_gemm(dtype, kernels)
    prompt_rows = (
        own_prefill and own in PROMPT_ROWS_ISAS["bfloat16" if dtype == torch.bfloat16 else "float32"]
    )
    extra: dict[str, Any] = {
        "own": own,
        "own_prefill": own_prefill,
        "own_version": version,
        "prompt_rows": prompt_rows,
    }
    if dtype == torch.bfloat16:
        ok = all(unpadded_rows_invariant(s, dtype, BF16_DECODE_PIECE) for s in shapes)
        return GemmRule(PREFILL_PIECE, BF16_DECODE_PIECE, pad_decode=not ok, **extra)
    return GemmRule(PREFILL_PIECE, F32_DECODE_PIECE, pad_decode=True, **extra)
