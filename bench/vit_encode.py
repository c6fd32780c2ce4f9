"""The Reasoner's ViT (Qwen3-VL-8B's, ~0.58B parameters) on one image or video: transformers' forward against
ours (models/cosmos3/vision_tower.py): SDPA eager, FA3 eager and serve's way (FA3 where it runs, compiled).

Builds `Qwen3VLVisionModel` at Nano's vision config (weights/tiny.py NANO_VISION_CONFIG; random, bf16 on a
GPU) and, per input, reports the median milliseconds of each forward over --repeats (after warm-up calls:
the compiled one's first call compiles), serve's speed-up and the relative L2 error of serve's against the
reference's merged embeddings and deepstack features; on a GPU also the profiler's top kernels at 720p. --tiny: the tiny ViT in float32 on the CPU (smoke test).

    PYTHONPATH=. python bench/vit_encode.py --out $OUT/vit_encode.json
    PYTHONPATH=. python bench/vit_encode.py --tiny --out /tmp/vit_encode.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from worldserve.bench.timing import time_region

INPUTS = {"image 1280x720": [[1, 44, 80]], "image 1920x1080": [[1, 68, 120]], "image 854x480": [[1, 30, 54]],
          "video 8 s at 2 fps, 640x360": [[8, 22, 40]]}  # fmt: skip
"""Patch grids (t, h, w) as the preprocessing gives them (a 720p image resizes to 1280x704: 44 x 80 patches)."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def variants(model, cuda: bool) -> dict:
    """label -> VisionTower over `model`: SDPA eager, and on a GPU FA3 eager (where it runs) and serve's way
    (VisionEncoder.set_attention_backend(None) + compile_math: the last one)."""
    from worldserve.models.cosmos3.vision_tower import VisionTower
    from worldserve.models.layers.flash_attention import resolve_attention_backend

    out = {"sdpa eager": VisionTower(model)}
    if cuda:
        p = next(model.parameters())
        label, fn = resolve_attention_backend(
            None, p.device, p.dtype, model.config.hidden_size // model.config.num_heads
        )
        if label == "fa3":
            out["fa3 eager"] = VisionTower(model, attention=fn)
        serve = VisionTower(model, attention=fn)
        serve.compile_math()
        out[f"{label} compiled (serve)"] = serve
    return out


def measure(label: str, g: torch.Tensor, model, towers: dict, repeats: int) -> dict:
    """One input's row: each forward's median ms, the last tower's largest relative L2 error against the
    reference."""
    p = next(model.parameters())
    x = torch.randn(int(g.prod(-1).sum()), 3 * 2 * 16 * 16, device=p.device, dtype=p.dtype)
    with torch.inference_mode():
        ref = model(x, grid_thw=g.to(p.device))
    ours, ds = list(towers.values())[-1].forward(x, g)
    errs = [
        rel(ours, ref.pooler_output),
        *(rel(a, b) for a, b in zip(ds, ref.deepstack_features, strict=True)),
    ]

    def ms_of(fn) -> float:  # (CUDA events around each call after a sync: host launch gaps included)
        return 1000 * time_region(fn, p.device, warmup=2, repeats=repeats).median

    ms = {"transformers": ms_of(lambda: model(x, grid_thw=g.to(p.device)))}
    for name, tower in towers.items():
        ms[name] = ms_of(lambda tower=tower: tower.forward(x, g))
    return {"input": label, "patches": int(x.shape[0]), "max_rel_l2_vs_reference": max(errs), "ms": ms}


def profile_top(tower, g: torch.Tensor, model, top: int = 10) -> str:
    """The CUDA kernels of one forward of `tower` on grid g, by total time (torch profiler's table)."""
    from torch.profiler import ProfilerActivity, profile

    p = next(model.parameters())
    x = torch.randn(int(g.prod(-1).sum()), 3 * 2 * 16 * 16, device=p.device, dtype=p.dtype)
    tower.forward(x, g)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        tower.forward(x, g)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=top)


def main() -> int:
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from worldserve.bench.report import environment
    from worldserve.weights.tiny import NANO_VISION_CONFIG, TINY_VISION_CONFIG

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file")
    ap.add_argument("--tiny", action="store_true", help="the tiny ViT, float32 on the CPU")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    cfg = Qwen3VLVisionConfig(**(TINY_VISION_CONFIG if args.tiny else NANO_VISION_CONFIG),
                              out_hidden_size=32 if args.tiny else 4096)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3VLVisionModel._from_config(cfg, dtype=dtype).eval()
    inputs = {"image 256x256": [[1, 16, 16]]} if args.tiny else INPUTS
    towers = variants(model, cuda)
    rows = [measure(label, torch.tensor(grid), model, towers, args.repeats) for label, grid in inputs.items()]
    res = {"environment": environment(device), "dtype": str(dtype), "config": cfg.to_dict(), "rows": rows}
    if cuda:
        res["profile_720p"] = profile_top(
            list(towers.values())[-1], torch.tensor(INPUTS["image 1280x720"]), model
        )
        print(res["profile_720p"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str))
    names = list(rows[0]["ms"])
    print("| input | patches | " + " | ".join(f"{n} ms" for n in names) + " | speed-up | max rel. L2 |")
    print("|---" * (len(names) + 4) + "|")
    for r in rows:
        ms = r["ms"]
        cells = " | ".join(f"{ms[n]:.2f}" for n in names)
        print(f"| {r['input']} | {r['patches']} | {cells} | {ms['transformers'] / ms[names[-1]]:.2f}x | "
              f"{r['max_rel_l2_vs_reference']:.1e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
