"""Benchmark the Cosmos3-Nano transformer's denoising forward (cond + uncond batched) on one CUDA GPU.

Builds the full-size Nano transformer on the meta device in bf16, materialises it with `to_empty` and
fills it with random normal weights (no checkpoint needed). It prefills a 300-token prompt for cond and
uncond once (prefill_und), then times `forward(GenBatch)` with both CFG branches in one call at
1280x720x189 frames (+197 audio latents) and at 832x480x121 (+127). It prints seconds per forward, peak
memory and TFLOP/s by the FLOP model of performance.md §1.3,
  F_fwd = L * [2 * N_g * P + 4 * N_g * (N_g + T) * H * d_h]   (per CFG branch, P = 192.9M per layer),
and writes JSON under $OUT (if set) or bench/results/. Importable without CUDA; running it needs one.
Usage: python bench/bench_transformer.py [--iters 3] [--warmup 1] [--text-tokens 300] [--no-sound]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from worldserve.models.cosmos3.batch import GenBatch, GenItem
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.models.cosmos3.transformer import Cosmos3Transformer

POINTS = ((1280, 720, 189), (832, 480, 121))
FPS = 24.0


@dataclass(frozen=True, slots=True)
class Result:
    width: int
    height: int
    frames: int
    latent: tuple[int, int, int, int]
    sound_frames: int
    gen_tokens: int
    text_tokens: int
    sec_per_forward: float
    """One batched forward of both CFG branches."""
    sec_per_branch: float
    tflops: float
    peak_mem_gib: float


def linear_params_per_layer(c: Cosmos3Config) -> int:
    d = c.hidden_size
    return d * c.q_dim + 2 * d * c.kv_dim + c.q_dim * d + 3 * d * c.intermediate_size


def forward_flops(c: Cosmos3Config, n_gen: int, n_text: int) -> float:
    """performance.md §1.3 F_fwd of one CFG branch."""
    p = linear_params_per_layer(c)
    per_layer = 2.0 * n_gen * p + 4.0 * n_gen * (n_gen + n_text) * c.num_attention_heads * c.head_dim
    return c.num_hidden_layers * per_layer


def build_random_nano(device: torch.device) -> Cosmos3Transformer:
    """Nano on meta -> to_empty -> N(0, 0.02) weights, unit norms (no checkpoint)."""
    with torch.device("meta"):
        model = Cosmos3Transformer(Cosmos3Config.nano(), dtype=torch.bfloat16)
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.post_load()
    return model.eval()


def latent_shape(width: int, height: int, frames: int) -> tuple[int, int, int, int]:
    return (48, 1 + (frames - 1) // 4, height // 16, width // 16)


def sound_frames(frames: int, fps: float) -> int:
    return math.ceil(int(frames / fps * 48000) / 1920)


def bench_point(model, caches, width, height, frames, *, sound: bool, warmup: int, iters: int) -> Result:
    device = model.device
    shape = latent_shape(width, height, frames)
    t_s = sound_frames(frames, FPS) if sound else 0
    latents = torch.randn(shape, device=device)
    snd = torch.randn(64, t_s, device=device) if sound else None
    t = torch.tensor(999, device=device)
    items = [GenItem(latents=latents, timestep=t, und_cache=c, fps=FPS, sound=snd) for c in caches]
    batch = GenBatch.pack(items, config=model.config, device=device)
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        model(batch)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        model(batch)
    torch.cuda.synchronize(device)
    sec = (time.perf_counter() - start) / iters
    n_gen = batch.num_tokens // len(items)
    flops = sum(forward_flops(model.config, n_gen, c.length) for c in caches)
    return Result(
        width=width,
        height=height,
        frames=frames,
        latent=shape,
        sound_frames=t_s,
        gen_tokens=n_gen,
        text_tokens=caches[0].length,
        sec_per_forward=sec,
        sec_per_branch=sec / len(items),
        tflops=flops / sec / 1e12,
        peak_mem_gib=torch.cuda.max_memory_allocated(device) / 2**30,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--text-tokens", type=int, default=300)
    ap.add_argument("--no-sound", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_transformer needs a CUDA GPU")
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_random_nano(device)
    weights_gib = torch.cuda.memory_allocated(device) / 2**30
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 151936, (args.text_tokens,), generator=gen) for _ in range(2)]  # cond, uncond
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    caches = model.prefill_und(prompts)
    torch.cuda.synchronize(device)
    prefill_sec = time.perf_counter() - t0
    print(
        f"weights {weights_gib:.1f} GiB; und prefill of 2x{args.text_tokens} tokens {prefill_sec * 1e3:.1f} ms"
    )
    results = []
    for width, height, frames in POINTS:
        r = bench_point(
            model,
            caches,
            width,
            height,
            frames,
            sound=not args.no_sound,
            warmup=args.warmup,
            iters=args.iters,
        )
        results.append(r)
        print(
            f"{width}x{height}x{frames}: N_g={r.gen_tokens} T={r.text_tokens} | {r.sec_per_forward:.3f} s/forward "
            f"(cond+uncond), {r.sec_per_branch:.3f} s/branch | {r.tflops:.0f} TFLOP/s | peak {r.peak_mem_gib:.1f} GiB"
        )
    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"bench_transformer_{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "dtype": "bfloat16",
        "weights_gib": weights_gib,
        "prefill_sec": prefill_sec,
        "iters": args.iters,
        "warmup": args.warmup,
    }
    path.write_text(json.dumps({**meta, "results": [asdict(r) for r in results]}, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
