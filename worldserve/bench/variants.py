"""Quick variants and diagnostics for the denoising step: kernel micro-benchmarks at the tower's real shapes,
a torch.compile'd gen layer, and a torch.profiler kernel table.

- `attention_micro`: SDPA at the joint gen shape (N_g queries over T + N_g keys, GQA 32/8, d 128) in our
  token-major layout (strided [1, H, N, D] views, `layers.attention.sdpa_attention`) vs contiguous [1, H, N, D]
  with cuDNN forced, vs PyTorch's default choice, vs cuDNN on both CFG items at once (B=2).
- `gemm_micro`: fused q|k|v and gate|up projections vs the separate GEMMs diffusers runs.
- `gen_layers_compiled`: the gen layers compiled (the model's own regional compile,
  `Cosmos3Transformer.compile_gen_layers`: one torch.compile'd qkv / finish graph shared by the 36 layers;
  attention stays eager) or eager for a block, then as they were.
- `layer_numerics`: one gen layer eager and compiled (bf16) against a float32 copy, to tell a wrong compiled
  path from bf16 rounding amplified over 36 random layers.
- `profile_step`: one call under torch.profiler; the kernel table goes to a text file and the kernel time
  is summed by category (attention, GEMM, copies/cat/index, other elementwise); `gpu_idle`: where the GPU
  waited for the host during the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from worldserve.bench.timing import time_region

if TYPE_CHECKING:
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer


def _tf(flops: float, s: float) -> float:
    return flops / s / 1e12


def attention_micro(
    n_gen: int,
    n_text: int,
    device: torch.device,
    *,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    repeats: int = 5,
) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from worldserve.models.layers.attention import sdpa_attention

    dt = torch.bfloat16
    q = torch.randn(n_gen, heads, head_dim, device=device, dtype=dt)  # token-major, as our layer has them
    k = torch.randn(n_text + n_gen, kv_heads, head_dim, device=device, dtype=dt)
    v = torch.randn_like(k)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))  # [1, H, N, D]
    flops = 4.0 * n_gen * (n_gen + n_text) * heads * head_dim
    out: dict = {"shape": f"{n_gen}x{n_gen + n_text}, GQA {heads}/{kv_heads}, d {head_dim}", "flops": flops}

    def native_cudnn() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)

    q2, k2, v2 = (torch.cat([x, x]) for x in (qh, kh, vh))  # CFG-batched B=2 (equal text lengths)

    def cudnn_b2() -> None:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q2, k2, v2, enable_gqa=True)

    cases: dict[str, Callable[[], object]] = {
        "ours_token_major": lambda: sdpa_attention(q, k, v),
        "bhnd_cudnn_forced": native_cudnn,
        "bhnd_default": lambda: F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True),
        "bhnd_cudnn_b2_per_item": cudnn_b2,
    }
    for name, fn in cases.items():
        try:
            t = time_region(fn, device, warmup=1, repeats=repeats)
            per = 2 if name.endswith("b2_per_item") else 1  # report per item
            out[name] = {"ms": t.median * 1e3 / per, "tflops": _tf(flops, t.median / per)}
        except RuntimeError as e:  # a backend that declines the shape
            out[name] = {"error": str(e).splitlines()[0][:200]}
    # What PyTorch's default picks (SDPBackend: 1 flash, 2 efficient, 3 cuDNN); private API, informative only.
    rep = heads // kv_heads
    for label, args, kw in (
        ("default_choice_gqa", (qh, kh, vh), {"enable_gqa": True}),
        ("default_choice_mha", (qh, kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)), {}),
    ):
        try:
            choice = int(torch._fused_sdp_choice(*args, **kw))
            out[label] = {1: "FLASH_ATTENTION", 2: "EFFICIENT_ATTENTION", 3: "CUDNN_ATTENTION"}.get(
                choice, choice
            )
        except Exception as e:
            out[label] = f"n/a ({type(e).__name__})"
    return out


class _FixedKV:
    """A stand-in und cache holding one layer's text K/V: the KVCache a gen step reads (`kv`, `length`);
    an und step's writes are refused."""

    def __init__(self, k: Tensor, v: Tensor) -> None:
        self.k, self.v = k, v
        self.length: int = k.shape[0]

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        return self.k, self.v

    def reserve(self, num_new: int) -> None:
        raise NotImplementedError("_FixedKV is read-only: a gen step's text K/V")

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError("_FixedKV is read-only: a gen step's text K/V")

    def advance(self, num_new: int) -> None:
        raise NotImplementedError("_FixedKV is read-only: a gen step's text K/V")


@torch.no_grad()
def layer_numerics(
    model: Cosmos3Transformer, device: torch.device, *, n_gen: int = 4096, n_text: int = 300, seed: int = 0
) -> dict:
    """One gen layer in bf16, eager and compiled, against a float32 copy of it (rel. L2 to float32).

    Small n_gen: the float32 reference runs SDPA's math kernel, which materialises the score matrix.
    """
    import copy

    from worldserve.bench.denoise import rel_error
    from worldserve.models.cosmos3.layer import gen_layer_step
    from worldserve.models.layers.attention import sdpa_attention

    blk = model.layers[0].gen
    g = torch.Generator(device=device).manual_seed(seed)
    d, hkv, hd = model.config.hidden_size, blk.num_kv_heads, blk.head_dim
    x = torch.randn(n_gen, d, device=device, generator=g).to(torch.bfloat16)
    kt = torch.randn(n_text, hkv, hd, device=device, generator=g).to(torch.bfloat16)
    vt = torch.randn(n_text, hkv, hd, device=device, generator=g).to(torch.bfloat16)
    pos = torch.arange(n_gen, dtype=torch.float32, device=device).expand(3, -1) + 15000.0
    cos, sin = model.rotary_emb.cos_sin(pos, torch.float32)
    spans = [(0, n_gen)]
    ref_blk = copy.deepcopy(blk).float()
    ref_blk.attn_fn = sdpa_attention  # the float32 reference runs SDPA's math kernel (FA3 is bf16-only)
    ref = gen_layer_step(ref_blk, 0, x.float(), cos, sin, [_FixedKV(kt.float(), vt.float())], spans)
    del ref_blk
    args = (0, x, cos.to(torch.bfloat16), sin.to(torch.bfloat16), [_FixedKV(kt, vt)], spans)
    with gen_layers_compiled(model, False):
        eager = gen_layer_step(blk, *args)
    with gen_layers_compiled(model, True):
        compiled = gen_layer_step(blk, *args)
    return {
        "tokens": n_gen,
        "eager_vs_fp32": rel_error(eager, ref),
        "compiled_vs_fp32": rel_error(compiled, ref),
        "compiled_vs_eager": rel_error(compiled, eager),
    }


def gemm_micro(
    n: int,
    device: torch.device,
    *,
    d: int = 4096,
    q: int = 4096,
    kv: int = 1024,
    inter: int = 12288,
    repeats: int = 10,
) -> dict:
    dt = torch.bfloat16
    x = torch.randn(n, d, device=device, dtype=dt)
    h = torch.randn(n, inter, device=device, dtype=dt)
    w = {
        name: torch.randn(rows, cols, device=device, dtype=dt) * 0.02
        for name, rows, cols in (
            ("qkv", q + 2 * kv, d),
            ("q", q, d),
            ("k", kv, d),
            ("v", kv, d),
            ("o", d, q),
            ("gate_up", 2 * inter, d),
            ("gate", inter, d),
            ("up", inter, d),
            ("down", d, inter),
        )
    }
    cases = {
        "qkv_fused": ([("x", "qkv")], 2.0 * n * d * (q + 2 * kv)),
        "qkv_separate": ([("x", "q"), ("x", "k"), ("x", "v")], 2.0 * n * d * (q + 2 * kv)),
        "gate_up_fused": ([("x", "gate_up")], 2.0 * n * d * 2 * inter),
        "gate_up_separate": ([("x", "gate"), ("x", "up")], 2.0 * n * d * 2 * inter),
        "o_proj": ([("x", "o")], 2.0 * n * q * d),
        "down_proj": ([("h", "down")], 2.0 * n * inter * d),
    }
    acts = {"x": x, "h": h}
    out: dict = {"tokens": n}
    for name, (ops, flops) in cases.items():

        def run(ops: list[tuple[str, str]] = ops) -> None:
            for a, b in ops:
                F.linear(acts[a], w[b])

        t = time_region(run, device, warmup=2, repeats=repeats)
        out[name] = {"ms": t.median * 1e3, "tflops": _tf(flops, t.median)}
    return out


@contextlib.contextmanager
def gen_layers_compiled(
    model: Cosmos3Transformer, compiled: bool, *, mode: str = "default"
) -> Iterator[None]:
    """The gen layers' math torch.compile'd (the model's own `compile_gen_layers`) or eager for the duration of
    the block; afterwards each layer gets back the functions it had (the product's compiled ones, or eager)."""
    from worldserve.models.cosmos3.layer import finish_math, merge_attention, qkv_math

    blocks = [layer.gen for layer in model.layers]
    slots = ("qkv_fn", "finish_fn", "merge_fn", "qkv_lora_fn", "finish_lora_fn")  # (an adapter's copies too)
    saved = [tuple(getattr(b, name) for name in slots) for b in blocks]
    if compiled:
        model.compile_gen_layers(mode=mode)
    else:
        for b in blocks:
            for name, fn in zip(
                slots, (qkv_math, finish_math, merge_attention, qkv_math, finish_math), strict=True
            ):
                setattr(b, name, fn)
    try:
        yield
    finally:
        for b, fns in zip(blocks, saved, strict=True):
            for name, fn in zip(slots, fns, strict=True):
                setattr(b, name, fn)


def _kernel_category(name: str) -> str:
    n = name.lower()
    if n.startswith("triton_"):  # inductor's fused kernels (names list every op fused: "copy", "cat", ...)
        return "fused elementwise (triton)"
    if any(s in n for s in ("fmha", "flash", "sdpa", "attention", "attn")):
        return "attention"
    if any(s in n for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_", "sm80_")):
        return "gemm"
    if any(s in n for s in ("copy", "memcpy", "memset", "cat", "index", "gather", "scatter")):
        return "copy/cat/index"
    return "elementwise/other"


def gpu_idle(events: Sequence[Any], top: int = 8) -> dict:
    """Where the GPU waited during a profiled call: `lead_ms` from the call's first host op to its first
    kernel, `gaps_ms` between kernels (the union of kernel / copy intervals against their span), the
    `top` longest gaps with the kernels around them (a host sync or slow host code mid-call shows here)."""
    from torch.autograd import DeviceType

    dev = sorted(
        ((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == DeviceType.CUDA),
        key=lambda x: x[0],
    )
    host_start = min((e.time_range.start for e in events if e.device_type != DeviceType.CUDA), default=0)
    if not dev:
        return {"lead_ms": 0.0, "gaps_ms": 0.0, "gaps": 0, "longest": []}
    gaps, busy_end, prev = [], dev[0][1], dev[0][2]
    for start, end, name in dev[1:]:
        if start > busy_end:
            gaps.append(((start - busy_end) / 1e3, prev[:60], name[:60]))
        if end > busy_end:
            busy_end, prev = end, name
    gaps.sort(key=lambda g: -g[0])
    return {
        "lead_ms": max(dev[0][0] - host_start, 0) / 1e3,
        "gaps_ms": sum(g[0] for g in gaps),
        "gaps": len(gaps),
        "longest": [{"ms": ms, "after": a, "before": b} for ms, a, b in gaps[:top]],
    }


HOST_CALLS = ("cudaMemcpyAsync", "cudaMemsetAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize")
"""Runtime calls `profile_step(stacks=True)` traces back to Python: copies and host syncs."""


def host_call_stacks(events: Sequence[Any], names: tuple[str, ...] = HOST_CALLS, depth: int = 8) -> str:
    """Each of `names`' calls traced to the Python code that issued it, counted per (call, stack), most
    frequent first. With `with_stack` the profiler records Python frames as events enclosing the ops
    (older versions: a `stack` list on the op); runtime calls hang under their op, so this walks up the
    parents and keeps the innermost `depth` frames."""
    counts: dict[tuple[str, tuple[str, ...]], int] = {}
    for e in events:
        if e.name not in names:
            continue
        frames: list[str] = []
        op = e.cpu_parent
        while op is not None and len(frames) < depth:
            if op.stack:
                frames += list(op.stack[: depth - len(frames)])
                break
            if ".py(" in op.name:
                frames.append(op.name)
            op = op.cpu_parent
        key = (e.name, tuple(frames) or ("(no Python frame)",))
        counts[key] = counts.get(key, 0) + 1
    lines = []
    for (name, stack), n in sorted(counts.items(), key=lambda kv: -kv[1]):
        lines.append(f"\n{name} x{n}:\n  " + "\n  ".join(stack))
    return "\n".join(lines) + "\n" if lines else ""


def profile_step(
    fn: Callable[[], object], device: torch.device, out_file: Path, *, row_limit: int = 40,
    stacks: bool = False,
) -> dict:  # fmt: skip
    """Run `fn` once under torch.profiler; write the kernel table to `out_file`; return category sums (ms).
    `stacks`: also append to the file the Python stacks that issued each of HOST_CALLS (with counts)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, with_stack=stacks) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    ka = prof.key_averages()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    out_file.parent.mkdir(parents=True, exist_ok=True)
    text = ka.table(sort_by=sort, row_limit=row_limit, max_name_column_width=90)
    if stacks:
        text += host_call_stacks(prof.events())
    out_file.write_text(text)
    kernels = []
    for e in ka:
        if device.type == "cuda" and e.device_type != DeviceType.CUDA:
            continue
        device_us = getattr(
            e, "self_device_time_total", None
        )  # (newer torch; the CUDA or CPU total before it)
        if device_us is not None:
            us = device_us
        else:
            us = getattr(e, "self_cuda_time_total", 0.0) if device.type == "cuda" else e.self_cpu_time_total
        kernels.append((e.key, us / 1e3, e.count))
    kernels.sort(key=lambda x: -x[1])
    idle = gpu_idle(prof.events()) if device.type == "cuda" else None
    cats: dict[str, float] = {}
    for name, ms, _ in kernels:
        cats[_kernel_category(name)] = cats.get(_kernel_category(name), 0.0) + ms
    total = sum(cats.values())
    return {
        "table_file": out_file.name,
        "kernel_ms_total": total,
        "gpu_idle": idle,
        "by_category_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
        "top_kernels": [
            {"name": n[:160], "ms": ms, "calls": c, "category": _kernel_category(n)}
            for n, ms, c in kernels[:15]
        ],
    }
