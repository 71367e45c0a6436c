"""LlamaRunner: an own forward for the Llama family over a paged KV pool, batch- and row-invariant.

    runner = LlamaRunner.from_model_runner(ModelRunner.load())   # same GGUF / HF folder loading
    pool = runner.new_pool(num_blocks=1024)
    logits = runner.step(pool, [Segment(tokens, start, table, decode=False, want_logits=True), ...])

One call runs one engine step: any mix of prefill chunks and decode rows of different requests,
in one pass through the weights (every linear layer is one GEMM over all the step's rows).

**Invariance.** A row's KV and logits depend only on its token, its absolute position and the KV
before it: never on the chunk it is in, how many rows the step has, or which requests share the
step. That is what makes every full 16-token block reusable and storable with bitwise-exact hits
(see docs/engine.md for the measurements behind each rule):

- Row counts: every weight product runs in pieces of fixed shape per row class (decode rows,
  prefill rows), as ``engine/gemm.py`` measures and explains: torch's CPU GEMMs pick their kernel
  from the row count. ``tests/engine/test_gemm.py`` checks every count the runner uses.
- Reductions over a row (RMSNorm, softmax sums) have many outputs, so torch runs
  each one whole on one thread.
- Attention reads keys in tiles of ``TILE`` positions at absolute multiples of ``TILE``. Scores
  ``q @ K^T`` reduce over ``head_dim`` only; the row max is exact in any order; ``exp`` is
  elementwise; each tile's ``P @ V`` is a GEMM of fixed shape, accumulated tile by tile in
  ascending order, and each tile's softmax mass likewise (``cumsum``). A tile past a row's
  position is fully masked: it adds exact zeros, so how many tiles a step reads changes nothing.
- Prefill rows and decode rows have different (each fixed) query shapes; a prompt's rows are
  always prefilled and generated tokens always decoded, with the cache on or off.

KV is stored in the compute dtype (post-RoPE); attention arithmetic runs in float32.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from prefixcache.cache.keys import KV_LAYOUT_VERSION, model_fingerprint
from prefixcache.engine.gemm import gemm_rule
from prefixcache.engine.kernels import matmul
from prefixcache.engine.kernels import mode as kernels_mode
from prefixcache.engine.llama_native import native_step, pick_kernels
from prefixcache.engine.model import ModelRunner
from prefixcache.engine.pool import KVPool
from prefixcache.engine.segment import Segment

log = logging.getLogger(__name__)

#: Key tile of the invariant attention (a multiple of every block size used).
TILE = 256
#: model_type values this runner computes; others use the Hugging Face runner.
SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def padded_rows(n: int) -> int:
    """Rows a GEMM runs for ``n`` real rows under the CUDA rule: a multiple of 4 (``engine/gemm.py``)."""
    return max(4, (n + 3) // 4 * 4)


def unsupported_reason(config: Any) -> str | None:
    """Why this runner cannot compute a model with ``config``, or None when it can."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_TYPES:
        return f"model_type {kind!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    return None


class _Attention:
    """One attention call's plan, shared by every layer of a step: which rows, their positions,
    the gathered block indices and the causal mask. Query layout ``[kv_heads, S, M, head_dim]``."""

    __slots__ = ("rows", "S", "M", "G", "decode", "index", "mask", "mask_from", "tiles")

    def __init__(
        self,
        rows: torch.Tensor,
        S: int,
        M: int,
        G: int,
        decode: bool,
        index: torch.Tensor,
        qpos: torch.Tensor,
        tiles: int,
    ) -> None:
        self.rows = rows  # step rows this call computes (real ones), in query order
        self.S, self.M, self.G, self.decode = S, M, G, decode
        self.index = index  # [S * T / B] block indices, padded with block 0
        self.tiles = tiles
        # Keys before every query's position are visible to all: only [mask_from, T) is masked.
        self.mask_from = int(qpos.min()) + 1
        keys = torch.arange(self.mask_from, tiles * TILE, device=qpos.device)
        self.mask = keys[None, None, :] > qpos[:, :, None]  # [S, M, T - mask_from]: True = masked


class LlamaRunner(ModelRunner):
    """The own forward for Llama-family models (Llama, SmolLM2, Mistral, Qwen2 with its biases).

    Shares identity and tokenizer with the :class:`ModelRunner` it is built from; the weights are
    copied into fused tensors in ``dtype`` (q/k/v as one GEMM, gate/up as one)."""

    kind = "llama"
    #: "compiled": steps whose products are all the own GEMM's run the layer loop in pc_layers;
    #: "python": always the loop in llama_native (the same bits; for tests and profiles).
    layer_loop = "compiled"

    def __init__(
        self,
        base: ModelRunner,
        *,
        dtype: str | None = None,
        attention: str = "invariant",
        kernels: str | None = None,
    ) -> None:
        """``attention="sdpa"`` swaps in torch's SDPA per call (not invariant: its work split
        depends on the query length): for measuring what invariance costs, and as the negative
        control of the exactness tests. Never for serving. ``kernels``: ``auto`` (the own CPU
        kernels where they build, see :mod:`prefixcache.engine.kernels`), ``native`` or
        ``torch``; None reads ``PREFIXCACHE_KERNELS``."""
        if attention not in ("invariant", "sdpa"):
            raise ValueError(f"attention must be 'invariant' or 'sdpa'; got {attention!r}")
        self.attention = attention
        hf = base.model
        reason = unsupported_reason(hf.config)
        if reason is not None:
            raise ValueError(f"the own runner cannot compute this model: {reason}; use runner='hf'")
        super().__init__(
            hf,
            base.tokenizer,
            weights_id=base.weights_id,
            name=base.name,
            dtype=dtype or base.dtype_name,
            threads=base.threads,
        )
        cfg = hf.config
        dt = self.dtype
        self.num_heads: int = cfg.num_attention_heads
        self.group = self.num_heads // self.num_kv_heads
        self.hidden: int = cfg.hidden_size
        self.eps = float(cfg.rms_norm_eps)
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True) and window < self.context_len:
            self.context_len = int(window)  # full attention is exact up to the window
        inner = hf.model

        def w(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(device=self.device, dtype=dt).contiguous()

        def cat(*ts: torch.Tensor | None) -> torch.Tensor | None:
            return None if any(t is None for t in ts) else torch.cat([w(t) for t in ts], 0)  # type: ignore[misc]

        self.layers: list[dict[str, torch.Tensor | None]] = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                {
                    "ln1": w(layer.input_layernorm.weight),
                    "qkv": cat(att.q_proj.weight, att.k_proj.weight, att.v_proj.weight),
                    "qkv_b": cat(att.q_proj.bias, att.k_proj.bias, att.v_proj.bias),
                    "o": w(att.o_proj.weight),
                    "o_b": w(att.o_proj.bias),
                    "ln2": w(layer.post_attention_layernorm.weight),
                    "gu": cat(mlp.gate_proj.weight, mlp.up_proj.weight),
                    "gu_b": cat(mlp.gate_proj.bias, mlp.up_proj.bias),
                    "down": w(mlp.down_proj.weight),
                    "down_b": w(mlp.down_proj.bias),
                }
            )
        self.embed: torch.Tensor = w(inner.embed_tokens.weight)  # type: ignore[assignment]  # (never None)
        self.norm = w(inner.norm.weight)
        head = hf.get_output_embeddings()
        tied = getattr(cfg, "tie_word_embeddings", False) or head is None
        self.lm_head: torch.Tensor = self.embed if tied else w(head.weight)  # type: ignore[assignment]
        self.scaling = float(getattr(inner.layers[0].self_attn, "scaling", self.head_dim**-0.5))
        # RoPE tables from the model's own rotary module (any rope_type transformers supports).
        with torch.inference_mode():
            positions = torch.arange(self.context_len, device=self.device)[None]
            probe = torch.zeros(1, device=self.device, dtype=torch.float32)
            cos, sin = inner.rotary_emb(probe, positions)
        self.cos = cos[0].to(dt).contiguous()  # [context, head_dim]
        self.sin = sin[0].to(dt).contiguous()
        shapes: set[tuple[int, int]] = {
            (t.shape[0], t.shape[1])
            for lw in self.layers
            for t in lw.values()
            if t is not None and t.dim() == 2
        }
        shapes.add((self.lm_head.shape[0], self.lm_head.shape[1]))
        # how every weight product keeps rows invariant (the own GEMM where the kernels load)
        self.gemm = gemm_rule(dt, self.device, sorted(shapes), kernels)
        self.model = None  # the Hugging Face modules are not used past this point
        self.lock = base.lock  # runners built from one base share the cores
        self.native, self.kernels = pick_kernels(self, kernels)

    @classmethod
    def from_model_runner(
        cls, base: ModelRunner, *, dtype: str | None = None, kernels: str | None = None
    ) -> LlamaRunner:
        """The own runner for ``base``'s model, built once per (base, dtype, kernels, GEMM ISA
        asked for) and reused (``kernels`` None: ``PREFIXCACHE_KERNELS``, default ``auto``; the
        ISA: ``PREFIXCACHE_KERNEL_ISA``, so a runner built under another cap is not handed back)."""
        if isinstance(base, LlamaRunner):
            if (dtype is None or dtype == base.dtype_name) and kernels is None:
                return base
            raise ValueError(
                f"this runner computes in {base.dtype_name} with kernels {base.kernels}; "
                f"build another one from the ModelRunner"
            )
        mode = kernels_mode() if kernels is None else kernels
        key = (dtype or base.dtype_name, mode, matmul.requested())
        made = base.__dict__.setdefault("_own_runners", {})
        if key not in made:
            made[key] = cls(base, dtype=key[0], kernels=mode)
        return made[key]

    def with_attention(self, attention: str) -> LlamaRunner:
        """The same runner (shared weights) with another attention (see ``__init__``)."""
        if attention not in ("invariant", "sdpa"):
            raise ValueError(f"attention must be 'invariant' or 'sdpa'; got {attention!r}")
        clone = copy.copy(self)
        clone.attention = attention
        if attention != "invariant":
            clone.native, clone.kernels = None, "torch"
        return clone

    # ------------------------------------------------------------------ identity
    def hit_alignment(self, block_size: int, prefill_chunk: int) -> int:
        """Hits may end on any block boundary: a row's bits do not depend on its pass."""
        return block_size

    def fingerprint(self, block_size: int, prefill_chunk: int = 0) -> str:
        """The model part of the cache namespace: weights, dtype, block size, the invariant
        layout (tile), the kernel set (``torch`` or the native kernels' version, ISA and source),
        the GEMM rule and device/threads (kernels may differ across them). The prefill chunk is not
        part of it: chunking does not change a row's bits."""
        parts = (KV_LAYOUT_VERSION, "paged", f"{self.attention}{TILE}", self.kernels, self.gemm.tag())
        layout = "|".join((*parts, self.device.type))
        if self.device.type == "cpu":
            layout += f"|t{self.threads}"
        return model_fingerprint(self.weights_id, self.dtype_name, block_size, layout)

    def new_pool(self, num_blocks: int, block_size: int = 16) -> KVPool:
        if TILE % block_size:
            raise ValueError(f"block_size ({block_size}) must divide the attention tile ({TILE})")
        return KVPool(
            layers=self.num_layers,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            num_blocks=num_blocks,
            dtype=self.dtype,
            device=self.device,
        )

    def block_nbytes(self, block_size: int = 16) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * block_size * self.head_dim * elem

    # ------------------------------------------------------------------ compute
    def forward(self, ids: Sequence[int], past: Any) -> Any:  # pragma: no cover - API guard
        raise TypeError("LlamaRunner computes steps over a KV pool: use step(), not forward()")

    def step(self, pool: KVPool, segments: Sequence[Segment]) -> torch.Tensor:
        """Run one step; returns float32 logits ``[n, vocab]``, one row per segment with
        ``want_logits``, in segment order. Writes every row's KV into its block."""
        with self.lock, torch.inference_mode():
            return self._step(pool, segments)

    def _step(self, pool: KVPool, segments: Sequence[Segment]) -> torch.Tensor:
        if self.native is not None:
            return native_step(self, self.native, pool, segments)
        dev, B = self.device, pool.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows: list[int] = []
        for seg in segments:
            n0 = len(tokens)
            tokens.extend(seg.tokens)
            span = range(seg.start, seg.end)
            positions.extend(span)
            table = seg.table
            slots.extend(table[p // B] * B + p % B for p in span)
            if seg.want_logits:
                last_rows.extend(range(n0, len(tokens)) if seg.all_logits else (len(tokens) - 1,))
            assert len(tokens) > n0, "a segment has no tokens"
        n = len(tokens)
        R = self.gemm.padded(n)
        rows = self.gemm.rows(segments, R)
        ids = torch.zeros(R, dtype=torch.long)
        ids[:n] = torch.tensor(tokens, dtype=torch.long)
        pos = torch.zeros(R, dtype=torch.long)
        pos[:n] = torch.tensor(positions, dtype=torch.long)
        ids, pos = ids.to(dev), pos.to(dev)
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        plans = self._plans(segments, B)
        cos = self.cos[pos][:, None, :]  # [R, 1, head_dim]
        sin = self.sin[pos][:, None, :]
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed[ids]  # [R, hidden]
        for li, lw in enumerate(self.layers):
            h = self._rms(x, lw["ln1"])
            qkv = self.gemm.linear(h, lw["qkv"], lw["qkv_b"], rows)  # [R, (H + 2 KV) * D]
            q = qkv[:, : H * D].view(R, H, D)
            k = qkv[:, H * D : (H + KV) * D].view(R, KV, D)
            v = qkv[:, (H + KV) * D :].view(R, KV, D)
            q = self._rope(q, cos, sin) * self.scaling
            k = self._rope(k, cos, sin)
            kp, vp = pool.keys(li), pool.values(li)  # [KV, blocks, B, D]
            nb = kp.shape[1]
            kp.view(KV, nb * B, D).index_copy_(1, slot_t, k[:n].transpose(0, 1))
            vp.view(KV, nb * B, D).index_copy_(1, slot_t, v[:n].transpose(0, 1).to(vp.dtype))
            attn = torch.zeros(R, H, D, dtype=q.dtype, device=dev)
            attend = self._attend if self.attention == "invariant" else self._attend_sdpa
            for plan in plans:
                attn[plan.rows] = attend(q, plan, kp, vp)
            x = x + self.gemm.linear(attn.view(R, H * D), lw["o"], lw["o_b"], rows)
            h = self._rms(x, lw["ln2"])
            gate, up = self.gemm.linear(h, lw["gu"], lw["gu_b"], rows).chunk(2, dim=-1)
            x = x + self.gemm.linear(F.silu(gate) * up, lw["down"], lw["down_b"], rows)
        if not last_rows:
            return torch.empty(0, self.vocab_size)
        want = len(last_rows)
        sel = torch.zeros(self.gemm.padded(want), dtype=torch.long)
        sel[:want] = torch.tensor(last_rows, dtype=torch.long)
        h = self._rms(x[sel.to(dev)], self.norm)
        return self.gemm.linear(h, self.lm_head, None, self.gemm.logits_rows(len(sel)))[:want].float()

    # ------------------------------------------------------------------ pieces
    def _rms(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) if weight is None else weight * h.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _plans(self, segments: Sequence[Segment], B: int) -> list[_Attention]:
        """The step's attention calls: one for all decode rows, one per prefill segment."""
        plans: list[_Attention] = []
        G, dev = self.group, self.device
        per_tile = TILE // B
        offsets, row = [], 0
        for seg in segments:
            offsets.append(row)
            row += len(seg.tokens)
        decode = [(i, s) for i, s in enumerate(segments) if s.decode]
        if decode:
            S = len(decode)
            M = max(4, (G + 3) // 4 * 4)  # the group's query rows, padded (see the module doc)
            tiles = max(-(-s.end // TILE) for _, s in decode)
            qpos = torch.tensor([s.end - 1 for _, s in decode], dtype=torch.long)[:, None].expand(S, M)
            index = torch.zeros(S, tiles * per_tile, dtype=torch.long)
            for j, (_, s) in enumerate(decode):
                used = -(-s.end // B)
                index[j, :used] = torch.tensor(list(s.table[:used]), dtype=torch.long)
            rows = torch.tensor([offsets[i] for i, _ in decode], dtype=torch.long)
            plans.append(
                _Attention(rows.to(dev), S, M, G, True, index.reshape(-1).to(dev), qpos.to(dev), tiles)
            )
        for i, s in enumerate(segments):
            if s.decode:
                continue
            n = len(s.tokens)
            rows_p = (n + 3) // 4 * 4  # query rows, padded (each brings G query heads)
            M = rows_p * G
            tiles = -(-s.end // TILE)
            qpos = torch.arange(s.start, s.start + rows_p).clamp(max=s.end - 1).repeat_interleave(G)[None]
            used = -(-s.end // B)
            index = torch.zeros(tiles * per_tile, dtype=torch.long)
            index[:used] = torch.tensor(list(s.table[:used]), dtype=torch.long)
            rows = torch.arange(offsets[i], offsets[i] + n)
            plans.append(_Attention(rows.to(dev), 1, M, G, False, index.to(dev), qpos.to(dev), tiles))
        return plans

    def _attend(self, q: torch.Tensor, plan: _Attention, kp: torch.Tensor, vp: torch.Tensor) -> torch.Tensor:
        """Invariant attention for ``plan``'s rows. ``q``: the step's [R, H, D] (scaled).
        Returns [rows, H, D] in ``q``'s dtype."""
        KV, D, G = self.num_kv_heads, self.head_dim, self.group
        S, M = plan.S, plan.M
        n = plan.rows.numel()
        qr = q[plan.rows].float()  # [n, H, D]
        if plan.decode:  # one row per sequence: [S, KV, G, D] -> [KV, S, M, D], G padded to M
            qa = torch.zeros(KV, S, M, D, dtype=torch.float32, device=q.device)
            qa[:, :, :G] = qr.view(S, KV, G, D).permute(1, 0, 2, 3)
        else:  # one sequence: [n, KV, G, D] -> [KV, 1, rows_p * G, D]
            qa = torch.zeros(KV, 1, M // G, G, D, dtype=torch.float32, device=q.device)
            qa[:, 0, :n] = qr.view(n, KV, G, D).permute(1, 0, 2, 3)
            qa = qa.view(KV, 1, M, D)
        T = plan.tiles * TILE
        keys = kp.index_select(1, plan.index).view(KV * S, T, D).float()
        values = vp.index_select(1, plan.index).view(KV * S, T, D).float()
        scores = torch.bmm(qa.view(KV * S, M, D), keys.transpose(1, 2)).view(KV, S, M, T)
        scores[..., plan.mask_from :].masked_fill_(plan.mask, float("-inf"))
        scores.sub_(scores.amax(-1, keepdim=True)).exp_()  # unnormalised P; masked entries exactly 0
        mass = scores.view(KV, S, M, plan.tiles, TILE).sum(-1).cumsum(-1)[..., -1:]  # [KV, S, M, 1]
        probs = scores.view(KV * S, M, T)
        out = torch.zeros(KV * S, M, D, dtype=torch.float32, device=q.device)
        for t in range(plan.tiles):  # fixed-shape GEMM per tile, ascending
            out.baddbmm_(probs[:, :, t * TILE : (t + 1) * TILE], values[:, t * TILE : (t + 1) * TILE])
        out = out.view(KV, S, M, D).div_(mass)
        if plan.decode:
            res = out[:, :, :G].permute(1, 0, 2, 3).reshape(S, KV * G, D)
        else:
            res = out.view(KV, M // G, G, D)[:, :n].permute(1, 0, 2, 3).reshape(n, KV * G, D)
        return res.to(q.dtype)

    def _attend_sdpa(
        self, q: torch.Tensor, plan: _Attention, kp: torch.Tensor, vp: torch.Tensor
    ) -> torch.Tensor:
        """Not invariant (see ``attention``): SDPA over the plan's gathered keys, causal mask."""
        KV, D, G = self.num_kv_heads, self.head_dim, self.group
        n, T = plan.rows.numel(), plan.tiles * TILE
        keys = kp.index_select(1, plan.index).view(KV, plan.S, T, D)
        values = vp.index_select(1, plan.index).view(KV, plan.S, T, D)
        qr = q[plan.rows]
        masked = torch.zeros(plan.S, plan.M, T, dtype=torch.bool, device=q.device)
        masked[..., plan.mask_from :] = plan.mask
        if plan.decode:
            qs = qr.view(plan.S, KV, G, D).permute(1, 0, 2, 3)  # [KV, S, G, D]
            allowed = ~masked[:, :1].expand(plan.S, G, T)
            out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=allowed, scale=1.0)
            return out.permute(1, 0, 2, 3).reshape(plan.S, KV * G, D)
        qs = qr.view(n, KV, G, D).permute(1, 2, 0, 3).reshape(KV, G * n, D)
        allowed = ~masked[0].view(-1, G, T)[:n].permute(1, 0, 2).reshape(G * n, T)
        out = F.scaled_dot_product_attention(qs, keys[:, 0], values[:, 0], attn_mask=allowed, scale=1.0)
        return out.view(KV, G, n, D).permute(2, 0, 1, 3).reshape(n, KV * G, D)
