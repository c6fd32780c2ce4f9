"""Wan2.2 VAE decode on one GPU: diffusers' AutoencoderKLWan vs our WanDecoder, eager and torch.compiled.

One diffusers `AutoencoderKLWan` with the real Nano config (`worldserve.bench.models.WAN22_VAE`) is built on
the device with its default random init (norm scales then set to 1 + 0.1 N(0, 1), so they matter) and cast
to bf16; our decoder loads the very same tensors from its state dict (`WanDecoder.from_diffusers`). Raw
latents [1, 48, 48, 45, 80] (-> 189 x 720 x 1280 pixels) are decoded by (a) diffusers, (b) ours eager,
(c) ours with `compile()`: seconds as the median of 3 after a warm-up (CUDA events), peak memory
(`max_memory_allocated`, absolute and above what was resident before the call), and the relative L2 and
max-abs difference of each of ours vs diffusers on the pixels. The warm-ups are short (diffusers decodes
frame by frame; ours sees the first-chunk, full-chunk and last-chunk shapes), except the compiled one,
which compiles (reported as compile_s). Results go to --out (JSON, rewritten after every phase); a table
is printed last. About 2-2.5 min on an H200.

    PYTHONPATH=. python bench/vae_decode.py --out $OUT/vae_decode.json
    PYTHONPATH=. python bench/vae_decode.py --tiny --out /tmp/vae_decode.json   # CPU smoke test of this script
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from worldserve.bench.models import TINY_VAE, WAN22_VAE
from worldserve.bench.timing import Timing, allocated_gib, free_memory, peak_gib, reset_peak, time_once
from worldserve.models.cosmos3.wan_decoder import DEFAULT_CHUNK_SIZE, WanDecoder
from worldserve.weights.tiny import WAN22_LATENTS_MEAN, WAN22_LATENTS_STD


def build_vae(device: torch.device, dtype: torch.dtype, *, tiny: bool, seed: int):
    """diffusers' AutoencoderKLWan, default init on the device, random norm scales, cast to `dtype`."""
    from diffusers import AutoencoderKLWan

    cfg = {
        **(TINY_VAE if tiny else WAN22_VAE),
        "latents_mean": WAN22_LATENTS_MEAN,
        "latents_std": WAN22_LATENTS_STD,
    }
    torch.manual_seed(seed)
    with torch.device(device):
        vae = AutoencoderKLWan(**cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g, device=device))
    return vae.to(dtype).eval().requires_grad_(False)


def compare(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Relative L2 and max |diff| in float32, a few frames at a time (the full tensors are ~1 GB each)."""
    num = den = 0.0
    max_abs = 0.0
    for i in range(0, ref.shape[2], 16):
        a, b = ours[:, :, i : i + 16].float(), ref[:, :, i : i + 16].float()
        num += float((a - b).double().square().sum())
        den += float(b.double().square().sum())
        max_abs = max(max_abs, float((a - b).abs().max()))
    return {"rel_l2": (num / den) ** 0.5 if den else float("nan"), "max_abs": max_abs}


def timed(name: str, fn, warm, device: torch.device, repeats: int, log) -> tuple[dict, torch.Tensor]:
    """Warm up with `warm()`, then time `fn()` `repeats` times; returns (stats, last output)."""
    t = Timing()
    t.warmup.append(time_once(warm, device))
    log(f"{name}: warm-up {t.warmup[0]:.2f} s")
    free_memory(device)
    resident = allocated_gib(device)
    reset_peak(device)
    box: list[torch.Tensor] = []
    for _ in range(repeats):
        box.clear()  # drop the previous output before the next decode allocates its own
        t.samples.append(time_once(lambda: box.append(fn()), device))
        log(f"{name}: {t.samples[-1]:.3f} s")
    peak = peak_gib(device)
    stats = {
        **t.to_dict(),
        "resident_gib": resident,
        "peak_gib": peak,
        "peak_above_resident_gib": peak - resident,
    }
    return stats, box[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON results file")
    ap.add_argument(
        "--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, help="latent frames per chunk (ours)"
    )
    ap.add_argument("--frames", type=int, default=48, help="latent frames (48 -> 189 pixel frames)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--extra-chunk-sizes", default="", help="comma list: also time ours eager at these sizes")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile'd variant")
    ap.add_argument("--compile-mode", default=None, help="torch.compile mode for ours (default: default)")
    ap.add_argument(
        "--profile", type=Path, default=None, help="torch.profiler kernel table of our last variant"
    )
    ap.add_argument("--tiny", action="store_true", help="tiny VAE, float32, on the CPU: a smoke test")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t_start = time.perf_counter()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    shape = (1, 48, args.frames, 2, 3) if args.tiny else (1, 48, args.frames, 45, 80)
    chunk = args.chunk_size

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    res: dict = {
        "latents": list(shape), "dtype": str(dtype), "chunk_size": chunk, "repeats": args.repeats,
        "torch": torch.__version__, "python": platform.python_version(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
    }  # fmt: skip

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")

    vae = build_vae(device, dtype, tiny=args.tiny, seed=args.seed)
    ours = WanDecoder.from_diffusers(vae)
    z = torch.randn(shape, generator=torch.Generator().manual_seed(args.seed + 1)).to(device, dtype)
    t = shape[2]
    warm_ours = (
        z[:, :, : 1 + chunk + (t - 1) % chunk] if t > 1 + chunk else z
    )  # first, full and last chunk shapes
    res["decoder_params"] = sum(p.numel() for p in ours.parameters())
    res["memory_format"] = str(ours.memory_format)
    log(f"built: decoder {res['decoder_params'] / 1e6:.0f}M params, latents {shape}, chunk {chunk}")

    with torch.inference_mode():
        res["diffusers"], ref = timed(
            "diffusers",
            lambda: vae.decode(z).sample,
            lambda: vae.decode(z[:, :, :3]),
            device,
            args.repeats,
            log,
        )
        res["pixels"] = list(ref.shape)
        res["pixels_std"] = float(ref.float()[:, :, ::8].std())
        save()

        res["ours_eager"], eager = timed(
            "ours eager", lambda: ours.decode(z, chunk_size=chunk), lambda: ours.decode(warm_ours, chunk_size=chunk),
            device, args.repeats, log,
        )  # fmt: skip
        res["ours_eager"].update(compare(eager, ref))
        log(f"ours eager vs diffusers: {res['ours_eager']['rel_l2']:.2e} rel L2")
        save()

        for extra in [int(s) for s in args.extra_chunk_sizes.split(",") if s]:
            stats, out = timed(
                f"ours eager chunk {extra}", lambda n=extra: ours.decode(z, chunk_size=n),
                lambda n=extra: ours.decode(z[:, :, : 1 + 2 * n], chunk_size=n), device, args.repeats, log,
            )  # fmt: skip
            res[f"ours_eager_chunk{extra}"] = {**stats, **compare(out, ref)}
            del out
            save()

        if not args.no_compile:
            ours.compile(**({"mode": args.compile_mode} if args.compile_mode else {}))
            res["ours_compiled"], compiled = timed(  # the warm-up compiles every chunk shape of the decode
                "ours compiled", lambda: ours.decode(z, chunk_size=chunk),
                lambda: ours.decode(warm_ours, chunk_size=chunk), device, args.repeats, log,
            )  # fmt: skip
            res["ours_compiled"]["compile_s"] = res["ours_compiled"]["warmup"][0]
            res["ours_compiled"].update(compare(compiled, ref))
            res["ours_compiled"]["vs_eager"] = compare(compiled, eager)
            save()

        if args.profile is not None:
            from worldserve.bench.variants import profile_step

            del ref, eager
            log("profiling one decode of our last variant")
            res["profile"] = profile_step(lambda: ours.decode(z, chunk_size=chunk), device, args.profile)
            save()

    res["wall_s"] = time.perf_counter() - t_start
    save()
    base = res["diffusers"]["median"]
    print(f"\nWan2.2 VAE decode {shape} -> {res['pixels']} {dtype}, chunk {chunk} ({res['device']})")
    print(
        f"{'variant':<22}{'median s':>10}{'speed-up':>10}{'peak GiB':>10}{'+GiB':>8}{'rel L2':>10}{'max abs':>9}"
    )
    for key in [k for k in res if k.startswith(("diffusers", "ours_"))]:
        r = res[key]
        rel = f"{r['rel_l2']:.2e}" if "rel_l2" in r else "-"
        mx = f"{r['max_abs']:.4f}" if "max_abs" in r else "-"
        print(
            f"{key:<22}{r['median']:>10.3f}{base / r['median']:>9.2f}x{r['peak_gib']:>10.1f}"
            f"{r['peak_above_resident_gib']:>8.1f}{rel:>10}{mx:>9}"
        )
    if "ours_compiled" in res:
        print(
            f"compile (first call, {warm_ours.shape[2]} latent frames): {res['ours_compiled']['compile_s']:.1f} s"
        )
    print(f"wall {res['wall_s']:.0f} s; JSON: {args.out}")


if __name__ == "__main__":
    main()
