"""One engine step of :class:`~prefixcache.engine.llama.LlamaRunner` through the own CPU kernels.

    logits = native_step(runner, kernels, pool, segments)   # same contract as LlamaRunner.step

Per layer: four GEMMs (``F.linear``, the same as the torch path) and four kernel calls:
RoPE + KV write into the pool, paged attention over every segment of the step at once (decode
rows and prefill chunks, K/V read in place through the block tables), and two RMSNorms fused
with the residual adds; SwiGLU between the MLP's GEMMs. Each kernel computes every row by the
same arithmetic whatever the batch, the row count and the thread count (pc_kernels.c's header),
so a row's bits depend only on its token, its position and the KV before it, as on the torch
path (they are not the torch path's bits: the cache namespace names the kernel set).

Where every weight product of the step goes through the own GEMM in one call (decode-only steps,
or prefill too where the GEMM rule sends prefill rows there) and the weights are dense, the whole
layer loop runs in compiled code (``pc_layers`` in ``kernels/pc_forward.c``): the same calls in
the same order, so the same bits, with one release of the GIL a step instead of one per kernel
(``runner.layer_loop = "python"`` keeps the loop here, for tests and profiles).
"""

from __future__ import annotations

import ctypes
import itertools
import operator
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from prefixcache.engine.kernels import KernelsUnavailableError, NativeKernels, resolve
from prefixcache.engine.kernels.matmul import ISAS
from prefixcache.engine.pool import KVPool

if TYPE_CHECKING:  # pragma: no cover
    from prefixcache.engine.gemm import GemmRule, Rows
    from prefixcache.engine.segment import Segment


class LlamaRunner(Protocol):
    """What the kernels' step reads of :class:`prefixcache.engine.llama.LlamaRunner` (named here,
    so this module does not import the torch runner that imports it)."""

    layers: list[dict[str, Any]]
    gemm: GemmRule
    dtype: torch.dtype
    dtype_name: str
    device: torch.device
    attention: str
    head_dim: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    eps: float
    scaling: float
    embed: torch.Tensor
    norm: torch.Tensor | None
    lm_head: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    layer_loop: str


#: Kernel dtype codes (pc_kernels.c).
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def pick_kernels(runner: LlamaRunner, kernels: str | None) -> tuple[NativeKernels | None, str]:
    """(the native kernels or None, the kernel set's id for the cache namespace) for ``runner``:
    ``kernels`` is auto|native|torch (None: ``PREFIXCACHE_KERNELS``)."""
    inter = runner.layers[0]["down"].shape[1] if runner.layers[0]["down"] is not None else 0
    shapes = (runner.head_dim, runner.hidden, inter)
    if (
        runner.device.type != "cpu"
        or runner.dtype not in DTYPE_CODES
        or runner.attention != "invariant"
        or any(n % 16 for n in shapes)
    ):
        if kernels == "native":
            raise KernelsUnavailableError(
                "the native kernels compute float32/bfloat16 invariant attention on the CPU, "
                f"head_dim/hidden/MLP width multiples of 16; this runner is {runner.dtype_name} on "
                f"{runner.device.type} ({runner.attention}), shapes {shapes}"
            )
        return None, "torch"
    native, _reason = resolve(kernels)
    return native, ("torch" if native is None else native.id)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


#: The weights of one layer, in the order pc_forward.c reads them (PC_LW pointers a layer).
LAYER_WEIGHTS = ("ln1", "qkv", "qkv_b", "o", "o_b", "ln2", "gu", "gu_b", "down", "down_b")


#: The projections a 4-bit runner holds as :class:`~prefixcache.engine.quant.Q4Weight`.
PROJECTIONS = ("qkv", "o", "gu", "down")


def layer_pointers(
    runner: LlamaRunner, decode_only: bool = False
) -> tuple[ctypes.Array[ctypes.c_void_p], int] | None:
    """(every layer's weight pointers for ``pc_layers``, the weight format: 0 dense, 1 4-bit, 2
    4-bit for decode rows and dequantized for prompt rows), or None when the step cannot run
    there. Dense contiguous weights of the runner's dtype always can. 4-bit weights on the own
    kernel (no bias) can: on a step of decode rows alone (``decode_only``) as themselves, and on
    any other step as themselves for its decode rows and through their dequantized ``dense``
    values for its prompt rows (as ``GemmRule.linear``), where the kernel's rows are bitwise the
    own GEMM's on ``dense`` (every GEMM ISA but AMX, see pc_q4.c), so a decode row has the same
    bits in either.

    Reading the ~300 pointers took 0.4 ms of a 10 ms decode step, so they are kept per runner and
    step kind, and reused while every weight object in ``runner.layers`` (and each 4-bit weight's
    ``dense`` tensor) is the one they were read from, checked by identity each step (about 0.1
    ms, measured in the step). The memo holds those objects, so a pointer never outlives its memory, and a
    weight swapped in place is read again at the next step."""
    now = _weight_objects(runner)
    memo = _POINTERS.setdefault(runner, {})
    kept = memo.get(decode_only)
    if kept is not None and len(kept[0]) == len(now) and all(map(operator.is_, kept[0], now)):
        return kept[1]
    made = _read_pointers(runner, decode_only)
    memo[decode_only] = (now, made)
    return made


#: layer_pointers' memo: runner -> {decode_only: (the weight objects, what was read from them)}.
_POINTERS: weakref.WeakKeyDictionary[Any, dict[bool, tuple[list[Any], Any]]] = weakref.WeakKeyDictionary()
_PICK = operator.itemgetter(*LAYER_WEIGHTS)


def _weight_objects(runner: LlamaRunner) -> list[Any]:
    """Every weight object ``pc_layers`` would read, then each 4-bit weight's ``dense``."""
    objs = list(itertools.chain.from_iterable(map(_PICK, runner.layers)))
    objs += [t.dense for t in objs if t is not None and not isinstance(t, torch.Tensor)]
    return objs


def _read_pointers(
    runner: LlamaRunner, decode_only: bool
) -> tuple[ctypes.Array[ctypes.c_void_p], int] | None:
    ptrs: list[int | None] = []
    kinds: set[int] = set()
    for lw in runner.layers:
        for name in LAYER_WEIGHTS:
            t = lw[name]
            if t is None:
                ptrs.append(None)
            elif isinstance(t, torch.Tensor) and t.dtype == runner.dtype and t.is_contiguous():
                ptrs.append(t.data_ptr())
                if name in PROJECTIONS:
                    kinds.add(0)
            elif name in PROJECTIONS and getattr(t, "desc", None) is not None and lw[f"{name}_b"] is None:
                if decode_only:
                    kinds.add(1)
                elif (t.a8 or t.isa not in (None, "amx")) and t.dense.dtype == runner.dtype:
                    kinds.add(2)
                else:
                    return None
                ptrs.append(t.kernel_view())
            else:
                return None
    if len(kinds) != 1:
        return None  # dense and 4-bit projections mixed: one format a call
    return (ctypes.c_void_p * len(ptrs))(*ptrs), kinds.pop()


def _compiled_loop(runner: LlamaRunner, rows: Rows) -> tuple[ctypes.Array[ctypes.c_void_p], int] | None:
    """The weight pointers and format when this step's layer loop can run in compiled code."""
    gemm = runner.gemm
    if runner.layer_loop != "compiled" or not gemm.own or gemm.legacy:
        return None
    decode_only = all(decode for _, _, decode in rows.runs)
    if not (gemm.own_prefill or decode_only):
        return None
    return layer_pointers(runner, decode_only)


class StepPlan:
    """What every layer of one step shares: rows' positions and KV slots, the attention segments
    ``[row0, rows, start, table offset, decode]`` and the concatenated block tables (int32)."""

    __slots__ = ("n", "R", "ids", "pos", "slots", "seg", "tables", "nseg", "last_rows")

    def __init__(self, segments: Sequence[Segment], B: int, R: int, num_blocks: int) -> None:
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seg: list[int] = []
        tables: list[int] = []
        self.last_rows: list[int] = []
        for s in segments:
            assert len(s.tokens) > 0, "a segment has no tokens"
            seg.extend((len(tokens), len(s.tokens), s.start, len(tables), int(s.decode)))
            used = -(-s.end // B)
            tables.extend(s.table[:used])
            positions.extend(range(s.start, s.end))
            table = s.table
            slots.extend(table[p // B] * B + p % B for p in range(s.start, s.end))
            tokens.extend(s.tokens)
            if s.want_logits:  # every row of the segment for prompt logprobs, else its last
                first = len(tokens) - len(s.tokens)
                self.last_rows.extend(range(first, len(tokens)) if s.all_logits else (len(tokens) - 1,))
        if tables and (min(tables) < 0 or max(tables) >= num_blocks):
            raise IndexError(f"a block table names a block outside the pool (0..{num_blocks - 1})")
        self.n, self.R = len(tokens), R
        self.ids = torch.zeros(R, dtype=torch.long)
        self.ids[: self.n] = torch.tensor(tokens, dtype=torch.long)
        self.pos = torch.zeros(R, dtype=torch.long)
        self.pos[: self.n] = torch.tensor(positions, dtype=torch.long)
        self.slots = torch.tensor(slots, dtype=torch.long)
        self.seg = torch.tensor(seg, dtype=torch.long)
        self.tables = torch.tensor(tables, dtype=torch.int32)
        self.nseg = len(segments)


def native_step(
    runner: LlamaRunner, k: NativeKernels, pool: KVPool, segments: Sequence[Segment]
) -> torch.Tensor:
    """``runner.step`` on the kernels (the caller holds the runner's lock, inference mode).
    The weight products go through the runner's GEMM rule (``engine/gemm.py``), as on the torch
    path: the same pieces, the same bits per row, dense or 4-bit weights."""
    gemm = runner.gemm
    R = gemm.padded(sum(len(s.tokens) for s in segments))
    rows = gemm.rows(segments, R)
    lib, dt = k.lib, DTYPE_CODES[runner.dtype]
    nt = torch.get_num_threads()
    B = pool.block_size
    plan = StepPlan(segments, B, R, pool.num_blocks)
    H, KV, D = runner.num_heads, runner.num_kv_heads, runner.head_dim
    hidden, n = runner.hidden, plan.n
    data = pool.data  # [layers, 2, KV, blocks, B, D], contiguous
    head_stride = data.shape[3] * B * D
    layers = runner.layers
    x = runner.embed[plan.ids]  # [R, hidden], the residual stream (updated in place)
    h = torch.empty_like(x)
    compiled = _compiled_loop(runner, rows)
    if compiled is not None and n == R:
        weights, wfmt = compiled
        inter = runner.layers[0]["down"].shape[1]
        dims = (ctypes.c_int64 * 6)(len(layers), H, KV, D, hidden, inter)
        rc = lib.pc_layers(
            dt, ISAS.index(gemm.own), wfmt, int(gemm.prompt_rows), R, dims, weights, _ptr(runner.norm),
            runner.eps, runner.scaling, x.data_ptr(), h.data_ptr(), data.data_ptr(), data.shape[3], B,
            plan.pos.data_ptr(), plan.slots.data_ptr(), runner.cos.data_ptr(), runner.sin.data_ptr(),
            plan.nseg, plan.seg.data_ptr(), plan.tables.data_ptr(), nt,
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"pc_layers failed ({'no memory' if rc == -3 else f'GEMM ISA {gemm.own}'})")
        return _logits(runner, h, plan)
    q = torch.empty(R, H, D, dtype=torch.float32)  # rows >= n are never read
    attn = torch.zeros(R, H * D, dtype=runner.dtype)  # padding rows stay zero
    lib.pc_rms_residual(
        dt, R, hidden, x.data_ptr(), None, _ptr(layers[0]["ln1"]), runner.eps, h.data_ptr(), nt
    )
    for li, lw in enumerate(layers):
        qkv = gemm.linear(h, lw["qkv"], lw["qkv_b"], rows)  # [R, (H + 2 KV) * D]
        keys, values = data[li, 0], data[li, 1]
        lib.pc_rope_kv(
            dt, n, H, KV, D, qkv.data_ptr(), plan.pos.data_ptr(), plan.slots.data_ptr(),
            runner.cos.data_ptr(), runner.sin.data_ptr(), runner.scaling, q.data_ptr(),
            keys.data_ptr(), values.data_ptr(), head_stride, nt,
        )  # fmt: skip
        lib.pc_attention(
            dt, H, KV, D, q.data_ptr(), keys.data_ptr(), values.data_ptr(), head_stride, B,
            plan.nseg, plan.seg.data_ptr(), plan.tables.data_ptr(), attn.data_ptr(), nt,
        )  # fmt: skip
        o = gemm.linear(attn, lw["o"], lw["o_b"], rows)
        lib.pc_rms_residual(
            dt, R, hidden, x.data_ptr(), o.data_ptr(), _ptr(lw["ln2"]), runner.eps, h.data_ptr(), nt
        )
        gu = gemm.linear(h, lw["gu"], lw["gu_b"], rows)
        inter = gu.shape[1] // 2
        act = torch.empty(R, inter, dtype=runner.dtype)
        lib.pc_swiglu(dt, R, inter, gu.data_ptr(), act.data_ptr(), nt)
        down = gemm.linear(act, lw["down"], lw["down_b"], rows)
        norm = layers[li + 1]["ln1"] if li + 1 < len(layers) else runner.norm
        lib.pc_rms_residual(
            dt, R, hidden, x.data_ptr(), down.data_ptr(), _ptr(norm), runner.eps, h.data_ptr(), nt
        )
    return _logits(runner, h, plan)


def _logits(runner: LlamaRunner, h: torch.Tensor, plan: StepPlan) -> torch.Tensor:
    """The float32 logits of the rows that want them (``h``: the final norm of every row)."""
    gemm = runner.gemm
    if not plan.last_rows:
        return torch.empty(0, runner.vocab_size)
    want = len(plan.last_rows)
    sel = torch.zeros(gemm.padded(want), dtype=torch.long)
    sel[:want] = torch.tensor(plan.last_rows, dtype=torch.long)
    return gemm.linear(h[sel], runner.lm_head, None, gemm.logits_rows(len(sel)))[:want].float()
