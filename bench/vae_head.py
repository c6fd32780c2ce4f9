"""The Wan2.2 decoder's head conv (conv_out: 256 -> 12 channels, 3x3x3, causal) in other forms, timed on a GPU.

At 720p the head runs on [1, 256, 2 + 8, 360, 640] per two-latent-frame chunk (24 chunks a 189-frame decode).
Its 12 output channels are too few for cuDNN's Hopper kernels: it picks an sm80 implicit GEMM with 32-wide
N tiles (~80 TFLOP/s, ~3.8 ms a chunk on an H100). Forms timed (each against the direct conv's output):
  direct-12      F.conv3d (cuDNN), the head before wan_head_conv.py
  padded-N       the weight zero-padded to N output channels (16, 32, ...), the first 12 kept: exact
  winograd-N     Winograd F(2, 3) along time (wan_decoder_convs.TimeWinogradConv3d), out padded to N
  triton         the product's `HeadConv3d` (wan_head_conv.py: a Triton implicit GEMM, clamp included),
                 autotuned, then each of its autotuner's configs alone (`--configs`)
With `--decode-frames T` (CUDA) it then decodes [1, 48, T, 45, 80] latents (T = 48: 720p x 189 frames) with a
compiled full-size WanDecoder (random weights), the head as cuDNN conv + clamp and as the Triton kernel,
alternating, and prints the seconds of each and their pixels' difference: the kernel's gain on a decode.

    PYTHONPATH=. python3 bench/vae_head.py [--frames 8] [--height 360] [--width 640] [--repeats 20]
    PYTHONPATH=. python3 bench/vae_head.py --configs --decode-frames 48 --out $OUT/vae_head.json
    PYTHONPATH=. python3 bench/vae_head.py --device cpu --height 24 --width 40 --repeats 2   # a smoke run
"""

from __future__ import annotations

import argparse
import json

import torch

from worldserve.models.cosmos3.wan_decoder_convs import TimeWinogradConv3d
from worldserve.models.cosmos3.wan_head_conv import HeadConv3d, kernel_runs, triton_head_conv, triton_kernels


def padded(conv: torch.nn.Conv3d, n: int) -> TimeWinogradConv3d:
    """`conv` with its output channels zero-padded to `n` (a TimeWinogradConv3d: plain or Winograd)."""
    out = TimeWinogradConv3d(conv.in_channels, n).to(device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        out.weight.zero_()
        out.bias.zero_()
        out.weight[: conv.out_channels] = conv.weight
        out.bias[: conv.out_channels] = conv.bias
    out.weight.data = out.weight.data.contiguous(memory_format=torch.channels_last_3d)
    return out


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of fn() over `repeats` runs after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=8)
    ap.add_argument("--height", type=int, default=360)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--channels", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pads", default="12,16,32,64")
    ap.add_argument("--configs", action="store_true", help="also time each Triton config alone")
    ap.add_argument("--decode-frames", type=int, default=0, help="also A/B a full decode of T latent frames")
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(args.channels, 12, 3, padding=(0, 1, 1)).to(device=device, dtype=dtype)
    conv.weight.data = conv.weight.data.contiguous(memory_format=torch.channels_last_3d)
    a = torch.randn(1, args.channels, 2 + args.frames, args.height, args.width, device=device, dtype=dtype)
    a = a.contiguous(memory_format=torch.channels_last_3d)
    flops = 2 * args.frames * args.height * args.width * 27 * args.channels * 12
    ref = conv(a).float()
    rows = []
    for n in (int(p) for p in args.pads.split(",")):
        for winograd in (False, True):
            m = padded(conv, n)
            m.time_winograd = winograd
            fn = (lambda m=m: m(a)[:, :12]) if n > 12 else (lambda m=m: m(a))
            err = ((fn().float() - ref).norm() / ref.norm()).item()
            s = timed(fn, args.repeats, device)
            rows.append({"form": f"{'winograd' if winograd else 'padded'}-{n}", "ms": s * 1e3,
                         "useful_tflops": flops / s / 1e12, "rel_err_vs_direct": err})  # fmt: skip
    direct = timed(lambda: conv(a), args.repeats, device)
    rows.insert(0, {"form": "direct-12 (cuDNN)", "ms": direct * 1e3, "useful_tflops": flops / direct / 1e12,
                    "rel_err_vs_direct": 0.0})  # fmt: skip
    head = HeadConv3d(args.channels, 12).to(device=device, dtype=dtype).eval().requires_grad_(False)
    head.load_state_dict(conv.state_dict())
    if kernel_runs(a, head.weight):
        clamped = ref.clamp(-1, 1)
        forms = [("triton (autotuned, product)", lambda: head(a))]
        if args.configs:
            kernels = triton_kernels()
            assert kernels is not None
            for cfg in kernels[1].configs:
                kw = cfg.kwargs
                tag = f"triton {kw['BH']}x{kw['BW']} w{cfg.num_warps} s{cfg.num_stages}"
                forms.append((tag, lambda c=cfg: triton_head_conv(a, head.weight, head.bias, config=c)))
        for form, fn in forms:
            err = ((fn().float() - clamped).norm() / clamped.norm()).item()
            s = timed(fn, args.repeats, device)
            rows.append(
                {"form": form, "ms": s * 1e3, "useful_tflops": flops / s / 1e12, "rel_err_vs_direct": err}
            )
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# head conv {args.channels}->12, input [1, {args.channels}, 2+{args.frames}, {args.height}, "
          f"{args.width}], {name}, torch {torch.__version__}")  # fmt: skip
    print("| form | ms | useful TFLOP/s | vs direct | rel. err vs direct |\n|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['form']} | {r['ms']:.3f} | {r['useful_tflops']:.0f} | {direct * 1e3 / r['ms']:.2f}x | "
              f"{r['rel_err_vs_direct']:.1e} |")  # fmt: skip
    decode = (
        decode_ab(args.decode_frames, args.repeats) if args.decode_frames and device.type == "cuda" else None
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": name,
                    "torch": torch.__version__,
                    "args": vars(args),
                    "rows": rows,
                    "decode": decode,
                },
                f,
                indent=1,
            )


def decode_ab(frames: int, repeats: int) -> dict:
    """A compiled full-size WanDecoder (random weights, bf16) decoding [1, 48, frames, 45, 80], its head as
    cuDNN conv + clamp (`fused = False`) and as the Triton kernel, alternating: median seconds of each."""
    from diffusers import AutoencoderKLWan

    from worldserve.bench.models import WAN22_VAE
    from worldserve.models.cosmos3.wan_decoder import WanDecoder

    with torch.device("cuda"):
        vae = AutoencoderKLWan(**WAN22_VAE).to(torch.bfloat16).eval().requires_grad_(False)
    dec = WanDecoder.from_diffusers(vae).compile()
    del vae
    z = torch.randn(1, 48, frames, 45, 80, device="cuda", dtype=torch.bfloat16)
    times: dict[str, list[float]] = {"cudnn": [], "triton": []}
    outs = {}
    for i in range(repeats + 1):
        for form in ("cudnn", "triton"):
            dec.decoder.conv_out.fused = form == "triton"
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            y = dec.decode(z)
            stop.record()
            stop.synchronize()
            if i:  # the first round compiles and autotunes
                times[form].append(start.elapsed_time(stop) / 1e3)
            outs[form] = y
            print(f"decode {form} round {i}: {start.elapsed_time(stop) / 1e3:.3f} s", flush=True)
    diff = ((outs["triton"].float() - outs["cudnn"].float()).norm() / outs["cudnn"].float().norm()).item()
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"| decode [1, 48, {frames}, 45, 80] | cuDNN head {med['cudnn']:.3f} s | Triton head {med['triton']:.3f} s "
          f"| {med['cudnn'] - med['triton']:+.3f} s | pixels rel. L2 {diff:.1e} |")  # fmt: skip
    return {"frames": frames, "seconds": times, "median": med, "rel_l2_triton_vs_cudnn": diff}


if __name__ == "__main__":
    main()
