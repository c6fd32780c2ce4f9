"""One Cosmos3 MoT layer: an und and a gen copy of a Qwen3 decoder block that meet only in attention.

`TowerBlock` holds one tower's weights (fused qkv_proj, per-head q/k RMSNorm, o_proj, fused gate_up_proj,
down_proj, two RMSNorms) and its two halves of the computation: `project_qkv` (pre-norm, q/k/v, q/k norm,
RoPE) and `finish` (o_proj + residual, SwiGLU MLP + residual). The two pathways built from them:
- `und_layer_step`: causal self-attention of new text tokens over their sequence's cached K/V (the new K/V
  are written into the cache first); text never sees gen tokens.
- `gen_layer_step`: gen queries attend, unmasked, to [und K/V of their item's prompt ; the item's gen K/V];
  optionally Ulysses-sharded (parallel/ulysses.py: tokens split across ranks, heads around attention).
The linear layers run over all packed tokens at once; only attention loops over the items / sequences
(per-item SDPA; packed varlen attention can replace the loop without touching the weights).

Regional compilation: the two halves are written as pure functions of (activations, weights)
(`qkv_math`, `finish_math`), so one `torch.compile`d copy of each serves all 36 layers (one graph per
shape, not 36); `compile_blocks` switches a set of blocks to them (single-rank only: the all-reduce of
a tensor-parallel o_proj / down_proj stays outside); there `finish` adds o_proj's and down_proj's
outputs into the residual stream inside the GEMMs, in place (`finish_residual_in_place`). The gen tower
compiles with static shapes (few, large). The und tower takes its own compiled copies
(`compiled_decode_math`, dynamic shapes) on a GPU: the Reasoner's decode step (runner/und_decoder.py,
captured in CUDA graphs) and its prefills (runner/und_prefill.py, through `und_layer_step(math=...)`); the
video pipeline's prompt K/V prefill runs eagerly.
FP8 (`TowerBlock.quantize_fp8`, gen tower only): qkv_proj, o_proj, gate_up_proj, down_proj become
`Fp8Linear`s (e4m3 weight + per-row scale, bf16 weight dropped); the same two pure functions then take the
scales (`*_s`) and route those GEMMs through `fp8_linear`, so compiled or not, one graph serves all layers
and the activation quantisation fuses with the norm / SwiGLU in front of each GEMM.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.cosmos3.gen_attention import GenAttentionBuffers, twin_attention
from worldserve.models.layers.attention import KVCache, sdpa_attention
from worldserve.models.layers.compile_limits import raise_recompile_limits
from worldserve.models.layers.flash_attention import AttentionFn, LseAttentionFn
from worldserve.models.layers.fp8 import Fp8Linear, fp8_linear
from worldserve.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from worldserve.models.layers.lora import LoraPair, with_lora
from worldserve.models.layers.norm import RMSNorm, rms_norm
from worldserve.models.layers.rope import apply_rope
from worldserve.parallel.groups import SINGLE, ParallelGroup
from worldserve.parallel.ulysses import head_slice, heads_to_seq, seq_to_heads

QkvFn = Callable[..., tuple[Tensor, Tensor, Tensor]]
"""qkv_math or a compiled copy of it: (h, cos, sin, weights...) -> q, k, v."""
FinishFn = Callable[..., Tensor]
"""finish_math or a compiled copy of it (finish_residual_in_place): (h, attn, weights...) -> h."""


def _linear(
    x: Tensor, w: Tensor, b: Tensor | None, s: Tensor | None, emulate: bool, fast_accum: bool
) -> Tensor:
    """F.linear, or the row-wise fp8 GEMM when the weight comes with its scale `s`."""
    if s is None:
        return F.linear(x, w, b)
    return fp8_linear(x, w, s, b, emulate=emulate, fast_accum=fast_accum)


def qkv_math(
    h: Tensor, cos: Tensor, sin: Tensor, ln_w: Tensor, qkv_w: Tensor, qkv_b: Tensor | None,
    qn_w: Tensor, kn_w: Tensor, eps: float, heads: int, kv_heads: int, head_dim: int,
    qkv_s: Tensor | None = None, emulate: bool = False, fast_accum: bool = True,
    kv_out: tuple[Tensor, Tensor, Tensor] | None = None, lora: LoraPair | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Pre-norm, fused q|k|v, per-head q/k RMSNorm, RoPE: h [N, d] -> q [N, Hq, D], k, v [N, Hkv, D].
    `lora`: an adapter's (A, B) for the fused q|k|v (models/layers/lora.py), added to its output.

    With `qkv_s` the weight is e4m3 with per-row scales [out, 1] (fp8_linear; `emulate`, `fast_accum`).
    With `kv_out` = (k_buf, v_buf [R, Hkv, D], rows [N] long), row i's k and v are stored at row rows[i]
    of the buffers (compiled, by the kernel that computes them) and the buffers come back in their place."""
    x = rms_norm(h, ln_w, eps)
    qkv = with_lora(_linear(x, qkv_w, qkv_b, qkv_s, emulate, fast_accum), x, lora)  # [N, q + 2 kv]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = rms_norm(q.unflatten(-1, (heads, head_dim)), qn_w, eps)  # [N, Hq, D]
    k = rms_norm(k.unflatten(-1, (kv_heads, head_dim)), kn_w, eps)  # [N, Hkv, D]
    q, k, v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.unflatten(-1, (kv_heads, head_dim))
    if kv_out is None:
        return q, k, v
    k_buf, v_buf, rows = kv_out
    return q, k_buf.index_copy_(0, rows, k), v_buf.index_copy_(0, rows, v)


def finish_math(
    h: Tensor, attn: Tensor, o_w: Tensor, o_b: Tensor | None, ln_w: Tensor, gu_w: Tensor, down_w: Tensor,
    eps: float, o_s: Tensor | None = None, gu_s: Tensor | None = None, down_s: Tensor | None = None,
    emulate: bool = False, fast_accum: bool = True, lora: tuple | None = None,
) -> Tensor:  # fmt: skip
    """Single-rank `finish`: h + o_proj(attn), then + down(silu(gate) * up) of the post-norm.

    With the scales `o_s`, `gu_s`, `down_s` those weights are e4m3 (fp8_linear), as in qkv_math. `lora`: an
    adapter's (o_proj, gate_up_proj, down_proj) pairs, each (A, B) or None (tower_lora)."""
    o_l, gu_l, down_l = lora or (None, None, None)
    a = attn.flatten(1)  # [N, Hq*D]
    h = h + with_lora(_linear(a, o_w, o_b, o_s, emulate, fast_accum), a, o_l)  # [N, d]
    x = rms_norm(h, ln_w, eps)
    gate, up = with_lora(_linear(x, gu_w, None, gu_s, emulate, fast_accum), x, gu_l).chunk(2, dim=-1)
    m = F.silu(gate) * up  # [N, I]
    return h + with_lora(_linear(m, down_w, None, down_s, emulate, fast_accum), m, down_l)


def swiglu_math(h: Tensor, ln_w: Tensor, gu_w: Tensor, eps: float, gu_lora: LoraPair | None = None) -> Tensor:
    """The MLP's hidden activations: silu(gate) * up of the post-norm residual stream h [N, d] -> [N, I]
    (`gu_lora`: an adapter's pair for gate|up)."""
    x = rms_norm(h, ln_w, eps)
    gate, up = with_lora(F.linear(x, gu_w), x, gu_lora).chunk(2, dim=-1)  # [N, 2I] -> 2 x [N, I]
    return F.silu(gate) * up


def finish_residual_in_place(
    h: Tensor, attn: Tensor, o_w: Tensor, o_b: Tensor | None, ln_w: Tensor, gu_w: Tensor, down_w: Tensor,
    eps: float, o_s: Tensor | None = None, gu_s: Tensor | None = None, down_s: Tensor | None = None,
    emulate: bool = False, fast_accum: bool = True, lora: tuple | None = None, *,
    swiglu_fn: Callable[..., Tensor] = swiglu_math, fallback: FinishFn = finish_math,
) -> Tensor:  # fmt: skip
    """finish_math whose two residual adds happen inside the GEMMs, in place: h += attn @ o_w^T and
    h += swiglu @ down_w^T are cuBLAS GEMMs with beta = 1 reading and writing h itself. h [N, d] is
    overwritten (the gen layers' residual stream, dead after the layer) and returned.

    Compiled, finish_math's `h + linear(...)` becomes an addmm into a new buffer, which PyTorch fills
    with a copy of h first: a [N, d] device copy per residual add (at 720p with CFG 0.33 ms, ~24 ms a
    step). Same arithmetic as that addmm (fp32 accumulate, one rounding). `swiglu_fn`: the compiled
    swiglu_math; fp8 weights (any of the scales), an o_proj bias, a non-contiguous h or autograd (the
    second add would overwrite what swiglu_fn saved for backward) take `fallback` (the compiled
    finish_math) instead. An adapter's deltas (`lora`, as finish_math's) are added in place the same way:
    h += (x A^T) B^T."""
    scaled = o_s is not None or gu_s is not None or down_s is not None
    if scaled or o_b is not None or not h.is_contiguous() or torch.is_grad_enabled():
        return fallback(
            h, attn, o_w, o_b, ln_w, gu_w, down_w, eps, o_s, gu_s, down_s, emulate, fast_accum, lora=lora
        )
    o_l, gu_l, down_l = lora or (None, None, None)
    a = attn.flatten(1)  # [N, Hq*D]
    h.addmm_(a, o_w.t())  # [N, Hq*D] @ [Hq*D, d], added to h
    if o_l is not None:
        h.addmm_(F.linear(a, o_l[0]), o_l[1].t())  # [N, R] @ [R, d]
    m = swiglu_fn(h, ln_w, gu_w, eps, gu_l)  # [N, I]
    h.addmm_(m, down_w.t())  # [N, I] @ [I, d], added to h
    return h if down_l is None else h.addmm_(F.linear(m, down_l[0]), down_l[1].t())


def merge_attention(o1: Tensor, lse1: Tensor, o2: Tensor, lse2: Tensor, out: Tensor) -> Tensor:
    """Attention over the union of two key sets from the two parts' outputs o [n, H, D] and softmax LSEs
    [H, n]: out = (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2), mixed in float32, stored into `out`."""
    w1 = torch.sigmoid(lse1.float() - lse2.float()).transpose(0, 1).unsqueeze(-1)  # [n, H, 1]
    return out.copy_(torch.lerp(o2.float(), o1.float(), w1))


FP8_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
"""The TowerBlock linears `quantize_fp8` converts (norms stay in the model dtype)."""


def _scale(linear: nn.Module) -> Tensor | None:
    return linear.weight_scale if isinstance(linear, Fp8Linear) else None


class TowerBlock(nn.Module):
    """One tower's half of a MoT layer (pre-norm attention block + SwiGLU MLP block)."""

    def __init__(self, config: Cosmos3Config, *, dtype: torch.dtype, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        d, hd, eps = config.hidden_size, config.head_dim, config.rms_norm_eps
        if config.num_key_value_heads % tp.size:
            raise ValueError(
                f"num_key_value_heads={config.num_key_value_heads} not divisible by tp={tp.size}"
            )
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = config.num_key_value_heads // tp.size
        self.head_dim = hd
        bias = config.attention_bias
        self.input_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.qkv_proj = ColumnParallelLinear(
            d, config.q_dim + 2 * config.kv_dim, bias=bias, dtype=dtype, tp=tp
        )
        self.q_norm = RMSNorm(hd, eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, eps, dtype=dtype)
        self.o_proj = RowParallelLinear(config.q_dim, d, bias=bias, dtype=dtype, tp=tp)
        self.post_attention_layernorm = RMSNorm(d, eps, dtype=dtype)
        self.gate_up_proj = ColumnParallelLinear(
            d, 2 * config.intermediate_size, bias=False, dtype=dtype, tp=tp
        )
        self.down_proj = RowParallelLinear(config.intermediate_size, d, bias=False, dtype=dtype, tp=tp)
        self.tp_size = tp.size
        self.qkv_fn = qkv_math
        self.finish_fn = finish_math
        self.qkv_lora_fn = qkv_math  # (compile_blocks: the copies an adapter's calls run, their own graphs)
        self.finish_lora_fn = finish_math
        self.fp8: dict[str, bool] = {}  # after quantize_fp8: the emulate / fast_accum flags of the math
        # flash_attention.resolve_attention_backend may swap in FA3; attn_lse_fn: (q, k, v) -> (out, LSE [H, n])
        # where the backend gives LSEs (FA3)
        self.attn_fn: AttentionFn = sdpa_attention
        self.attn_lse_fn: LseAttentionFn | None = None
        self.merge_fn = merge_attention

    def project_qkv(
        self,
        h: Tensor,
        cos: Tensor,
        sin: Tensor,
        fn: QkvFn | None = None,
        kv_out: tuple[Tensor, Tensor, Tensor] | None = None,
        lora: Mapping[str, LoraPair] | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """h [N, d] -> q [N, Hq, D], k [N, Hkv, D] (normed, rotated), v [N, Hkv, D]; `fn`: another copy of
        qkv_math to run (the Reasoner decoder's compiled one), default this block's; `kv_out`: buffers the
        k / v rows are stored into (qkv_math); `lora`: this block's adapter deltas (LoraWeights.tower)."""
        pair = None if lora is None else lora.get("qkv_proj")
        return (fn or (self.qkv_fn if pair is None else self.qkv_lora_fn))(
            h, cos, sin, self.input_layernorm.weight, self.qkv_proj.weight, self.qkv_proj.bias,
            self.q_norm.weight, self.k_norm.weight, self.input_layernorm.eps,
            self.num_heads, self.num_kv_heads, self.head_dim, _scale(self.qkv_proj), **self.fp8,
            kv_out=kv_out, lora=pair,
        )  # fmt: skip

    def finish(
        self, h: Tensor, attn: Tensor, fn: FinishFn | None = None, lora: Mapping[str, LoraPair] | None = None
    ) -> Tensor:
        """Residual stream h [N, d] + o_proj(attn [N, Hq, D]), then + SwiGLU MLP; `fn`: another copy of
        finish_math for a single rank (the Reasoner decoder's compiled one), default this block's; `lora`: this
        block's adapter deltas (LoraWeights.tower)."""
        pairs = None if lora is None else tuple(lora.get(n) for n in ("o_proj", "gate_up_proj", "down_proj"))
        if self.tp_size == 1:
            adapted = pairs is not None and any(p is not None for p in pairs)
            return (fn or (self.finish_lora_fn if adapted else self.finish_fn))(
                h, attn, self.o_proj.weight, self.o_proj.bias, self.post_attention_layernorm.weight,
                self.gate_up_proj.weight, self.down_proj.weight, self.post_attention_layernorm.eps,
                _scale(self.o_proj), _scale(self.gate_up_proj), _scale(self.down_proj), **self.fp8, lora=pairs,
            )  # fmt: skip
        o_l, gu_l, down_l = pairs or (None, None, None)
        h = h + self.o_proj(attn.flatten(1), o_l)  # [N, Hq*D] -> [N, d]; all-reduce across TP ranks
        gate, up = self.gate_up_proj(self.post_attention_layernorm(h), gu_l).chunk(2, dim=-1)
        return h + self.down_proj(F.silu(gate) * up, down_l)

    def quantize_fp8(self, *, emulate: bool = False, fast_accum: bool = True) -> None:
        """Replace the four GEMM weights by e4m3 + per-row scales (fp8.Fp8Linear), dropping the originals.

        Call after loading (the checkpoint loader writes into the bf16 parameters). Single-rank only."""
        if self.tp_size != 1:
            raise ValueError("fp8 GEMMs support tensor_parallel_size 1 only")
        if self.fp8:
            raise ValueError("this block is already quantised to fp8")
        for name in FP8_LINEARS:
            setattr(
                self, name, Fp8Linear.from_linear(getattr(self, name), emulate=emulate, fast_accum=fast_accum)
            )
        self.fp8 = {"emulate": emulate, "fast_accum": fast_accum}


def compile_blocks(blocks: Sequence[TowerBlock], *, mode: str = "default", backend: str = "inductor") -> None:
    """Route `blocks` through one shared torch.compile'd copy of qkv_math / swiglu_math (static shapes: one
    graph per shape), their residual adds done in place by the GEMMs (finish_residual_in_place: the
    blocks' `finish` then overwrites its input h, so only blocks whose callers drop h may be compiled:
    the gen layers)."""
    raise_recompile_limits()  # one graph per packed-token count: a server meets many (compile_limits.py)
    qkv_c = torch.compile(qkv_math, mode=mode, backend=backend, dynamic=False)
    finish_c = torch.compile(finish_math, mode=mode, backend=backend, dynamic=False)
    swiglu_c = torch.compile(swiglu_math, mode=mode, backend=backend, dynamic=False)
    merge_c = torch.compile(merge_attention, mode=mode, backend=backend, dynamic=False)
    finish = partial(finish_residual_in_place, swiglu_fn=swiglu_c, fallback=finish_c)
    # an adapter's calls get copies of their own (their own code objects, so their own graphs): their ranks
    # are dynamic (LoraWeights.mark_ranks_dynamic), and torch 2.11's inductor GEMM padding pass weighs a GEMM
    # on its symbolic sizes, guarding the rank to its decision's range (2 <= r <= 12 for rank 4: a rank-16
    # adapter compiled again); these copies compile without that pass, the base graphs keep it
    # (torch.compile takes a mode or options, not both: an inductor mode's options, padding off)
    inductor = backend == "inductor"
    options = (
        {**torch._inductor.list_mode_options(mode or "default"), "shape_padding": False} if inductor else None
    )
    lora_mode = None if inductor else mode

    def lora_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(fn, mode=lora_mode, backend=backend, dynamic=False, options=options)

    # (lambdas: code objects of their own, each with its own graph cache, distinct from the base copies')
    qkv_l = lora_copy(lambda *a, **k: qkv_math(*a, **k))
    finish_l = lora_copy(lambda *a, **k: finish_math(*a, **k))
    swiglu_l = lora_copy(lambda *a, **k: swiglu_math(*a, **k))
    finish_lora = partial(finish_residual_in_place, swiglu_fn=swiglu_l, fallback=finish_l)
    for block in blocks:
        block.qkv_fn, block.qkv_lora_fn = qkv_c, qkv_l
        block.merge_fn = merge_c
        if block.tp_size == 1:
            block.finish_fn, block.finish_lora_fn = finish, finish_lora


def compiled_decode_math(*, mode: str = "default", backend: str = "inductor") -> tuple[QkvFn, FinishFn]:
    """(qkv, finish): torch.compile'd copies of qkv_math / finish_math for the Reasoner's decode step.

    Their own code objects (dynamo caches graphs per code object: the gen tower's static graphs never serve a
    decode step), automatic dynamic shapes: a graph for batch 1, one for the rest (the prefill graphs' pieces
    their own). Every Reasoner of the process shares the lambdas' code objects, so the recompile limits are
    raised, or past dynamo's default 8 graphs they would run eagerly without a word."""
    raise_recompile_limits()
    qkv = torch.compile(lambda *a, **k: qkv_math(*a, **k), mode=mode, backend=backend)
    finish = torch.compile(lambda *a, **k: finish_math(*a, **k), mode=mode, backend=backend)
    return qkv, finish


class MoTLayer(nn.Module):
    """The und and gen TowerBlocks of one layer (nothing inside a layer is shared between towers)."""

    def __init__(self, config: Cosmos3Config, *, dtype: torch.dtype, tp: ParallelGroup = SINGLE) -> None:
        super().__init__()
        self.und = TowerBlock(config, dtype=dtype, tp=tp)
        self.gen = TowerBlock(config, dtype=dtype, tp=tp)


def _cat(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def und_layer_step(
    block: TowerBlock,
    layer: int,
    h: Tensor,
    cos: Tensor,
    sin: Tensor,
    caches: Sequence[KVCache],
    seq_lens: Sequence[int],
    *,
    kv_only: bool = False,
    math: tuple | None = None,
    lora: Mapping[str, LoraPair] | None = None,
) -> Tensor | None:
    """One und layer over the new tokens h [N, d] of len(caches) sequences; writes their K/V.

    Returns the updated residual stream, or None with `kv_only` (only the K/V were wanted). `math`: the
    (qkv, finish) functions to run instead of the block's (compiled_decode_math's, on a GPU); `lora`: the
    block's adapter deltas (a video prompt's K/V under a LoRA adapter).
    """
    qkv_fn, finish_fn = math or (None, None)
    q, k, v = block.project_qkv(h, cos, sin, qkv_fn, lora=lora)
    outs, start = [], 0
    for cache, n in zip(caches, seq_lens, strict=True):
        k_all, v_all = cache.write(layer, k[start : start + n], v[start : start + n])
        if not kv_only:
            outs.append(block.attn_fn(q[start : start + n], k_all, v_all, causal=True))
        start += n
    if kv_only:
        return None
    return block.finish(h, _cat(outs), finish_fn, lora)


def gen_layer_step(
    block: TowerBlock,
    layer: int,
    g: Tensor,
    cos: Tensor,
    sin: Tensor,
    caches: Sequence[KVCache],
    spans: Sequence[tuple[int, int]],
    sp: ParallelGroup = SINGLE,
    buffers: GenAttentionBuffers | None = None,
    lora: Mapping[str, LoraPair] | None = None,
) -> Tensor:
    """One gen layer over the packed gen stream g [N, d]; item i owns rows spans[i] = (start, count);
    `lora`: the block's adapter deltas (every item of the stream runs with the same adapter).

    With `buffers` (one rank of the sequence, sp.size == 1) the K/V and the attention output live in its
    workspace. With a Ulysses group `sp` of P ranks, g / cos / sin are this rank's block of the stream
    padded to a multiple of P (parallel/ulysses.py): q/k/v go all-to-all to "all tokens, my heads" around
    attention, whose text K/V are this rank's KV heads; spans index the full stream."""
    if buffers is not None:
        buffers.load_text(layer, caches)
        q, _, _ = block.project_qkv(g, cos, sin, kv_out=(buffers.k, buffers.v, buffers.rows), lora=lora)
        twins = buffers.twins if layer == 0 and block.attn_lse_fn is not None else ()
        for group in twins:
            twin_attention(block, q, buffers, group)
        shared = {i for group in twins for i in group}
        for i, (start, n) in enumerate(spans):
            if i not in shared:
                block.attn_fn(q[start : start + n], *buffers.keys(i), out=buffers.out[start : start + n])
        return block.finish(g, buffers.out, lora=lora)
    q, k, v = block.project_qkv(g, cos, sin, lora=lora)
    q, k, v = seq_to_heads(q, sp), seq_to_heads(k, sp), seq_to_heads(v, sp)  # [N_pad, H/P, D] each
    outs = []
    for cache, (start, n) in zip(caches, spans, strict=True):
        k_und, v_und = (head_slice(x, sp) for x in cache.kv(layer))  # [L_text, Hkv/P, D]
        k_i = torch.cat([k_und, k[start : start + n]])  # [L_text + n, Hkv/P, D]
        v_i = torch.cat([v_und, v[start : start + n]])
        outs.append(block.attn_fn(q[start : start + n], k_i, v_i))
    if sp.size > 1 and (pad := q.shape[0] - sum(n for _, n in spans)):
        outs.append(q.new_zeros(pad, *q.shape[1:]))  # the padding rows (never read back)
    return block.finish(g, heads_to_seq(_cat(outs), sp), lora=lora)
