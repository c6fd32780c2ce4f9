"""The Reasoner's prefill at full size: time to the first token's logits over prompt lengths, three ways.

Loads a random full-size Cosmos3-Nano (bench/parallel_step.py writes it once, with its Qwen3-VL ViT and the
tiny byte tokenizer) into three Reasoners over the same transformer, prefix caching off in all:
- `graphed`: the serve default on a GPU: passes of up to 2,048 tokens replay piecewise CUDA graphs
  (runner/prefill_graphs.py), larger ones run the compiled layer math;
- `compiled`: the compiled layer math (the decode step's dynamic-shape copies) without the graphs;
- `eager`: `--enforce-eager` (every layer's ~100 small ops dispatched one by one: the prefill before both).
For each --lengths entry, `start()` of a raw prompt of that many token ids, built beforehand as the API
builds it, is timed (best of --rounds, the variants alternating): the in-process time to the first token
(prefill, final norm, lm_head, the first token's pick). Also a 720p image prompt (a new image each round:
the ViT runs; the encoder cache never hits), and the first-token logits of graphed against eager (relative
L2, bf16). Each length's floor on an H200 is the larger of streaming the und tower's weights once (15.1 GB at
4.3 TB/s = 3.5 ms, performance.md §1) and its GEMM FLOPs at 790 TFLOP/s. --profile N also writes torch
profiler tables of one N-token start() per variant.

    PYTHONPATH=. python bench/prefill_floor.py --random-nano /tmp/nano-random --out $OUT/prefill_floor.json
    PYTHONPATH=. python bench/prefill_floor.py --tiny --out /tmp/prefill_floor.json    # CPU smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

WEIGHT_STREAM_MS = 15.1e9 / 4.3e12 * 1e3  # performance.md §1: the und tower's bf16 weights read once
PEAK_FLOPS = 790e12  # performance.md: dense bf16 on an H200


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_step import reasoner_bench_parser

    ap = reasoner_bench_parser(__doc__)
    ap.add_argument("--lengths", default="16,75,256,843,2048,8192", help="prompt token counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--profile", type=int, default=0, help="also profile one start() of this many tokens per "
                    "variant: torch profiler tables (CPU and CUDA time by op) next to --out")  # fmt: skip
    return ap.parse_args(argv)


def floor_ms(model, tokens: int) -> float:
    """max(weight streaming, GEMM FLOPs at the peak) of one prefill of `tokens` tokens (attention ignored)."""
    per_token = 2 * sum(p.numel() for layer in model.layers for p in layer.und.parameters())
    return max(WEIGHT_STREAM_MS, per_token * tokens / PEAK_FLOPS * 1e3)


def timed_first_token(reasoner, params, sync) -> tuple[float, object]:
    """(seconds, first-token logits on the CPU) of start() of `params` built beforehand."""
    params = dataclasses.replace(params, prebuilt=reasoner.build_prompt(params))
    sync()
    t0 = time.perf_counter()
    session = reasoner.start(params)
    sync()
    took = time.perf_counter() - t0
    logits = session.pending_logits.float().cpu()
    session.close()
    return took, logits


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from worldserve.bench.report import environment
    from worldserve.chat_params import ChatMessage, ChatParams, ChatPart
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_step import reasoner_setup

    root, device, dtype, sync, _scratch = reasoner_setup(args.tiny, args.random_nano)  # (_scratch: tiny's)
    model = load_transformer(root, dtype=dtype, device=device, progress=False)
    tok = AutoTokenizer.from_pretrained(str(root / "text_tokenizer"))
    lengths = [int(x) for x in args.lengths.split(",")]
    opts = {"kv_cache_tokens": 65536, "max_model_len": 32768, "enable_prefix_caching": False}
    variants = {
        "graphed": Reasoner.from_pretrained(root, model, tok, **opts),
        "compiled": Reasoner.from_pretrained(root, model, tok, **opts),
        "eager": Reasoner.from_pretrained(root, model, tok, enforce_eager=True, **opts),
    }
    variants["compiled"].prefiller.graphs = None  # (on the CPU all three run eagerly)
    for r in variants.values():
        r.warm_up()
    rng = np.random.default_rng(0)
    h, w = (64, 96) if args.tiny else (720, 1280)

    def prompt(n: int, r: int) -> ChatParams:
        ids = tuple(int(x) for x in rng.integers(0, 256, n))
        return ChatParams(prompt_ids=ids, max_tokens=1, temperature=0.0)

    def image_prompt(r: int) -> ChatParams:
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        content = (ChatPart(type="image", image=image), ChatPart(type="text", text=f"({r}) What is this?"))
        return ChatParams(
            messages=(ChatMessage(role="user", content=content),), max_tokens=1, temperature=0.0
        )

    cases = {f"text_{n}": (lambda r, n=n: prompt(n, r)) for n in lengths}
    cases["image_720p" if not args.tiny else "image_64x96"] = image_prompt
    res: dict = {"environment": environment(device), "command": " ".join(sys.argv), "dtype": str(dtype),
                 "cases": {}}  # fmt: skip
    for name, make in cases.items():
        times: dict[str, list[float]] = {v: [] for v in variants}
        logits: dict[str, object] = {}
        for r in range(-1, args.rounds):  # round -1: first calls of the shape, untimed
            params = make(r)
            for label, reasoner in variants.items():
                t, lg = timed_first_token(reasoner, params, sync)
                if r >= 0:
                    times[label].append(t)
                    logits[label] = lg
        n = len(variants["graphed"].build_prompt(make(0)).input_ids)
        best = {v: 1000 * min(ts) for v, ts in times.items()}
        lg, le = logits["graphed"], logits["eager"]
        res["cases"][name] = {
            "prompt_tokens": n, **{f"first_token_ms_{v}": ms for v, ms in best.items()},
            "speedup_over_eager": best["eager"] / best["graphed"], "floor_ms": floor_ms(model, n),
            "graphed_over_floor": best["graphed"] / floor_ms(model, n),
            "logits_rel_l2": ((lg - le).norm() / le.norm()).item(),
            "all_ms": {v: [1000 * t for t in ts] for v, ts in times.items()},
        }  # fmt: skip
    if args.profile:
        res["profile"] = profile(variants, prompt(args.profile, 0), sync, args.out)
    return res


def profile(variants: dict, params, sync, out: Path) -> dict:
    """Per variant: one start() of `params` under the torch profiler (its op tables written next to `out`),
    and the split of its wall time between the prefill pass (prefill_batch, synchronised) and the rest."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    found = {}
    for label, reasoner in variants.items():
        prefill, spent = reasoner.prefill_batch, []

        def timed(*a, prefill=prefill, spent=spent, **k):
            sync()
            t0 = time.perf_counter()
            y = prefill(*a, **k)
            sync()
            spent.append(time.perf_counter() - t0)
            return y

        reasoner.prefill_batch = timed
        try:
            wall, _ = timed_first_token(reasoner, params, sync)
        finally:
            del reasoner.prefill_batch
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with torch_profile(activities=acts) as prof:
            timed_first_token(reasoner, params, sync)
        avg = prof.key_averages()
        text = avg.table(sort_by="cpu_time_total", row_limit=60) + "\n\n" + avg.table(
            sort_by="self_cpu_time_total", row_limit=40)  # fmt: skip
        out.with_name(f"{out.stem}-profile-{label}.txt").write_text(text)
        found[label] = {"wall_ms": 1000 * wall, "prefill_ms": 1000 * sum(spent),
                        "ops": sum(e.count for e in avg if e.key.startswith("aten::"))}  # fmt: skip
        print(label, found[label])
    return found


def table(res: dict) -> str:
    rows = ["| case | prompt tokens | graphed ms | compiled ms | eager ms | eager / graphed | floor ms "
            "| graphed / floor | logits rel L2 |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, c in res["cases"].items():
        rows.append(f"| {name} | {c['prompt_tokens']} | {c['first_token_ms_graphed']:.1f} | "
                    f"{c['first_token_ms_compiled']:.1f} | {c['first_token_ms_eager']:.1f} | "
                    f"{c['speedup_over_eager']:.2f}x | {c['floor_ms']:.1f} | {c['graphed_over_floor']:.2f}x | "
                    f"{c['logits_rel_l2']:.2e} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # (puts bench/ on the path)
    from parallel_step import reasoner_bench_main

    return reasoner_bench_main(args, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
