"""The Reasoner's ViT (Qwen3-VL-8B's, ~0.58B parameters) on one image or video: transformers' forward against
ours (models/cosmos3/vision_tower.py), eager and compiled, on the same random weights.

Builds `Qwen3VLVisionModel` at Nano's vision config (weights/tiny.py NANO_VISION_CONFIG; random, bf16 on a
GPU) and, per input, reports the median milliseconds of each forward over --repeats (after warm-up calls:
the compiled one's first call compiles), the speed-ups and the relative L2 error of ours against the
reference's merged embeddings and deepstack features. --tiny: the tiny ViT in float32 on the CPU (smoke test).

    PYTHONPATH=. python bench/vit_encode.py --out $OUT/vit_encode.json
    PYTHONPATH=. python bench/vit_encode.py --tiny --out /tmp/vit_encode.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

INPUTS = {"image 1280x720": [[1, 44, 80]], "image 1920x1080": [[1, 68, 120]], "image 854x480": [[1, 30, 54]],
          "video 8 s at 2 fps, 640x360": [[8, 22, 40]]}  # fmt: skip
"""Patch grids (t, h, w) as the preprocessing gives them (a 720p image resizes to 1280x704: 44 x 80 patches)."""


def timed(fn, sync, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def measure(label: str, g: torch.Tensor, model, eager, compiled, sync, repeats: int) -> dict:
    """One input's row: the three forwards' median ms, ours' largest relative L2 error against the reference."""
    p = next(model.parameters())
    x = torch.randn(int(g.prod(-1).sum()), 3 * 2 * 16 * 16, device=p.device, dtype=p.dtype)
    with torch.inference_mode():
        ref = model(x, grid_thw=g.to(p.device))
    ours, ds = (compiled or eager).forward(x, g)
    errs = [
        rel(ours, ref.pooler_output),
        *(rel(a, b) for a, b in zip(ds, ref.deepstack_features, strict=True)),
    ]
    return {"input": label, "patches": int(x.shape[0]), "max_rel_l2_vs_reference": max(errs),
            "reference_ms": timed(lambda: model(x, grid_thw=g.to(p.device)), sync, repeats, 2),
            "ours_eager_ms": timed(lambda: eager.forward(x, g), sync, repeats, 2),
            "ours_compiled_ms": timed(lambda: compiled.forward(x, g), sync, repeats, 2) if compiled else None}  # fmt: skip


def main() -> int:
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    from worldserve.bench.report import environment
    from worldserve.models.cosmos3.vision_tower import VisionTower
    from worldserve.weights.tiny import NANO_VISION_CONFIG, TINY_VISION_CONFIG

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file")
    ap.add_argument("--tiny", action="store_true", help="the tiny ViT, float32 on the CPU")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = Qwen3VLVisionConfig(**(TINY_VISION_CONFIG if args.tiny else NANO_VISION_CONFIG),
                              out_hidden_size=32 if args.tiny else 4096)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3VLVisionModel._from_config(cfg, dtype=dtype).eval()
    inputs = {"image 256x256": [[1, 16, 16]]} if args.tiny else INPUTS
    eager, compiled = VisionTower(model), VisionTower(model)
    if cuda:
        compiled.compile_math()
    rows = [measure(label, torch.tensor(grid), model, eager, compiled if cuda else None, sync, args.repeats)
            for label, grid in inputs.items()]  # fmt: skip
    res = {"environment": environment(device), "dtype": str(dtype), "config": cfg.to_dict(), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2, default=str))
    print("| input | patches | transformers ms | ours eager ms | ours compiled ms | speed-up | max rel. L2 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        best = r["ours_compiled_ms"] or r["ours_eager_ms"]
        comp = f"{r['ours_compiled_ms']:.2f}" if r["ours_compiled_ms"] else "-"
        print(f"| {r['input']} | {r['patches']} | {r['reference_ms']:.2f} | {r['ours_eager_ms']:.2f} | {comp} | "
              f"{r['reference_ms'] / best:.2f}x | {r['max_rel_l2_vs_reference']:.1e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
