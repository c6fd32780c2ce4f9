"""Wan2.2 VAE decode on one GPU: diffusers' AutoencoderKLWan vs our WanDecoder (its residual convs plain or
as Winograd F(2, 3) in time), eager and torch.compiled, and how far each bf16 decode is from float32.

One diffusers `AutoencoderKLWan` with the real Nano config (`worldserve.bench.models.WAN22_VAE`) is built on
the device with its default random init (norm scales then set to 1 + 0.1 N(0, 1), so they matter) and cast
to bf16; our decoders load the very same tensors from its state dict (`WanDecoder.from_diffusers`). Raw
latents [1, 48, 48, 45, 80] (-> 189 x 720 x 1280 pixels) are decoded by (a) diffusers, (b) ours eager,
(c) ours with `compile()`, (b) and (c) with the plain and / or the Winograd convs (`--time-winograd`):
seconds as the median of --repeats after a warm-up (CUDA events), peak memory (`max_memory_allocated`,
absolute and above what was resident before the call), and the relative L2 and max-abs difference of each
of ours vs diffusers on the pixels. The warm-ups are short (diffusers decodes frame by frame; ours sees the
first-chunk, full-chunk and last-chunk shapes), except the compiled ones, which compile (compile_s). Then
(`--accuracy-frames`, default 13 latent frames) every bf16 decode of the clip's start is compared with ours
in float32 (TF32 off): relative L2, PSNR (pixels span [-1, 1]) and max |diff|. Results go to --out (JSON,
rewritten after every phase); tables are printed last. About 3-4 min on an H200.

    PYTHONPATH=. python bench/vae_decode.py --no-eager --out $OUT/vae_decode.json
    PYTHONPATH=. python bench/vae_decode.py --tiny --out /tmp/vae_decode.json   # CPU smoke test of this script
"""

from __future__ import annotations

import argparse
import json
import math
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
    count = ref.numel()
    for i in range(0, ref.shape[2], 16):
        a, b = ours[:, :, i : i + 16].float(), ref[:, :, i : i + 16].float()
        num += float((a - b).double().square().sum())
        den += float(b.double().square().sum())
        max_abs = max(max_abs, float((a - b).abs().max()))
    psnr = 20 * math.log10(2.0 / (num / count) ** 0.5) if num else float("inf")  # pixels span [-1, 1]
    return {"rel_l2": (num / den) ** 0.5 if den else float("nan"), "max_abs": max_abs, "psnr_db": psnr}


def accuracy(vae, z: torch.Tensor, compiled: dict, chunk: int, log) -> dict:
    """Each bf16 decode of the short clip `z` (diffusers', ours eager direct / Winograd, the compiled
    variants) against ours in float32 from the same weights (TF32 off): how much each loses to rounding."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        truth = (
            WanDecoder.from_diffusers(vae)
            .float()
            .set_time_winograd(False)
            .decode(z.float(), chunk_size=chunk)
        )
        log(f"float32 decode of {z.shape[2]} latent frames done")
    eager = WanDecoder.from_diffusers(vae)
    outs = {
        "diffusers": lambda: vae.decode(z).sample,
        "ours_eager_direct": lambda: eager.set_time_winograd(False).decode(z, chunk_size=chunk),
        "ours_eager_winograd": lambda: eager.set_time_winograd(True).decode(z, chunk_size=chunk),
        **{key: lambda d=dec: d.decode(z, chunk_size=chunk) for key, dec in compiled.items()},
    }
    res = {"latent_frames": z.shape[2], "vs_float32": {}}
    for key, fn in outs.items():
        res["vs_float32"][key] = compare(fn(), truth)
        log(f"{key} vs float32: {res['vs_float32'][key]}")
    return res


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
    ap.add_argument("--no-eager", action="store_true", help="skip our eager variant")
    ap.add_argument(
        "--time-winograd", choices=("on", "off", "both"), default="both",
        help="ours with the residual convs as Winograd F(2, 3) in time (the default), as plain Conv3d, or both",
    )  # fmt: skip
    ap.add_argument(
        "--accuracy-frames", type=int, default=13,
        help="latent frames of the float32 accuracy check (0: none): each bf16 decode vs ours in float32",
    )  # fmt: skip
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

        winograd = {"on": [True], "off": [False], "both": [False, True]}[args.time_winograd]
        name = {False: "direct", True: "winograd"}  # the residual convs as Conv3d / Winograd F(2, 3) in time
        if not args.no_eager:
            for wino in winograd:
                ours.set_time_winograd(wino)
                key = f"ours_eager_{name[wino]}"
                res[key], out = timed(
                    key, lambda: ours.decode(z, chunk_size=chunk), lambda: ours.decode(warm_ours, chunk_size=chunk),
                    device, args.repeats, log,
                )  # fmt: skip
                res[key].update(compare(out, ref))
                log(f"{key} vs diffusers: {res[key]['rel_l2']:.2e} rel L2")
                del out
                save()

        for extra in [int(s) for s in args.extra_chunk_sizes.split(",") if s]:
            stats, out = timed(
                f"ours eager chunk {extra}", lambda n=extra: ours.decode(z, chunk_size=n),
                lambda n=extra: ours.decode(z[:, :, : 1 + 2 * n], chunk_size=n), device, args.repeats, log,
            )  # fmt: skip
            res[f"ours_eager_chunk{extra}"] = {**stats, **compare(out, ref)}
            del out
            save()

        compiled: dict[str, WanDecoder] = {}
        if not args.no_compile:
            del ours  # each compiled variant is a decoder of its own (1.1 GB of weights)
            for wino in winograd:
                key = f"ours_compiled_{name[wino]}"
                dec = WanDecoder.from_diffusers(vae).set_time_winograd(wino)
                dec.compile(**({"mode": args.compile_mode} if args.compile_mode else {}))
                res[key], out = timed(  # the warm-up compiles every chunk shape of the decode
                    key, lambda d=dec: d.decode(z, chunk_size=chunk),
                    lambda d=dec: d.decode(warm_ours, chunk_size=chunk), device, args.repeats, log,
                )  # fmt: skip
                res[key]["compile_s"] = res[key]["warmup"][0]
                res[key].update(compare(out, ref))
                compiled[key] = dec
                del out
                save()

        if args.accuracy_frames:
            res["accuracy"] = accuracy(vae, z[:, :, : args.accuracy_frames], compiled, chunk, log)
            save()

        if args.profile is not None and compiled:
            from worldserve.bench.variants import profile_step

            del ref
            dec = list(compiled.values())[-1]
            log("profiling one decode of our last variant")
            res["profile"] = profile_step(lambda: dec.decode(z, chunk_size=chunk), device, args.profile)
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
    for key in [k for k in res if k.startswith("ours_compiled")]:
        print(
            f"{key} compile (first call, {warm_ours.shape[2]} latent frames): {res[key]['compile_s']:.1f} s"
        )
    if "accuracy" in res:
        acc = res["accuracy"]
        print(f"\naccuracy on {acc['latent_frames']} latent frames, each vs ours in float32 (TF32 off):")
        print(f"{'variant':<26}{'rel L2':>10}{'PSNR dB':>9}{'max abs':>9}")
        for key, r in acc["vs_float32"].items():
            print(f"{key:<26}{r['rel_l2']:>10.2e}{r['psnr_db']:>9.2f}{r['max_abs']:>9.4f}")
    print(f"wall {res['wall_s']:.0f} s; JSON: {args.out}")


if __name__ == "__main__":
    main()
