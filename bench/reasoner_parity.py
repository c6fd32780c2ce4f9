"""The Reasoner at full size against transformers' Qwen3-VL: image, video and text chats, logits and tokens.

The tests compare the Reasoner with transformers' `Qwen3VLForConditionalGeneration` on the tiny checkpoint
in float32 on the CPU. This runs the same comparison at Cosmos3-Nano's real sizes (the 8B und tower, the
0.58B ViT with its deepstack layers, 720p images and a video) on the GPU: the product's Reasoner in bf16
(prefill + 8 greedy decode steps through the paged K/V cache and the graphed decode), and the oracle
(`worldserve/bench/reasoner_oracle.py`) twice, in float32 (the reference) and in bf16 (what the same
weights give in transformers at our precision). Reported per chat: the relative error of every prefill and
decode logit against the float32 oracle, ours next to transformers' bf16 (their ratio: 1.0 means our bf16
path is as close to exact as transformers' own), the share of positions whose top token agrees with the
float32 oracle, whether our greedy tokens equal the float32 oracle's argmax, and our prefill time (ViT
included, first call excluded by a warm-up chat).

    PYTHONPATH=. python bench/reasoner_parity.py --random-nano /tmp/nano-random --out $OUT/parity.json
    PYTHONPATH=. python bench/reasoner_parity.py --tiny --out /tmp/parity.json      # CPU smoke test (fp32)
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

STEPS = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_step import reasoner_bench_parser

    ap = reasoner_bench_parser(__doc__)
    return ap.parse_args(argv)


def chats(tiny: bool) -> dict:
    """name -> ChatParams: a 720p image (a 64x96 one on tiny), a 16-frame video, a text chat."""
    from worldserve.chat_params import ChatMessage, ChatParams, ChatPart, ChatVideo

    rng = np.random.default_rng(0)
    h, w = (64, 96) if tiny else (720, 1280)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    vh, vw = (64, 96) if tiny else (352, 640)  # frames as the API hands them: multiples of 32
    frames = rng.integers(0, 256, (16, vh, vw, 3), dtype=np.uint8)
    video = ChatVideo(frames=frames, indices=tuple(range(0, 48, 3)), source_fps=24.0)

    def user(*parts):
        return ChatParams(messages=(ChatMessage(role="user", content=parts),), temperature=0.0)

    return {
        "image_720p": user(ChatPart(type="image", image=image), ChatPart(type="text", text="What is this?")),
        "video_16_frames": user(
            ChatPart(type="video", video=video), ChatPart(type="text", text="What happens?")
        ),
        "text": user(ChatPart(type="text", text="Describe the weather on Mars in three sentences.")),
    }


def ours(reasoner, params, sync) -> dict:
    """Prefill + STEPS greedy decode steps -> prompt, logits [N + STEPS, V] float32 (CPU), tokens, time."""
    prompt = reasoner.build_prompt(params)
    sync()
    t0 = time.perf_counter()
    hidden, seq, pos = reasoner.prefill(prompt)  # the ViT, then the und tower over the prompt
    sync()
    prefill_s = time.perf_counter() - t0
    logits = [reasoner.transformer.compute_logits(hidden).float().cpu()]  # [N, V]
    tokens = []
    for _ in range(STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(reasoner.decode(tokens[-1], seq, pos).float().cpu()[None])
        pos += 1
    seq.release()
    return {"prompt": prompt, "logits": torch.cat(logits), "tokens": tokens, "prefill_s": prefill_s}


@torch.no_grad()
def oracle_logits(model, prompt, tokens, pad_ids: tuple[int, int], device) -> torch.Tensor:
    """The oracle's logits [N + STEPS, V] float32 (CPU) of the prompt followed by our greedy tokens;
    `pad_ids`: the image and video placeholder ids."""
    seq = torch.tensor(prompt.input_ids + tokens, device=device)[None]
    kind = (seq == pad_ids[0]).int() + 2 * (seq == pad_ids[1]).int()
    kind[:, len(prompt.input_ids) :] = 0  # a generated placeholder id is text (as the Reasoner treats it)
    kwargs = {"mm_token_type_ids": kind}
    dtype = next(model.parameters()).dtype
    if prompt.vision is not None:
        kwargs.update(pixel_values=prompt.vision.pixel_values(device).to(dtype),
                      image_grid_thw=prompt.vision.grid_thw.to(device))  # fmt: skip
    if prompt.video is not None:
        kwargs.update(pixel_values_videos=prompt.video.pixel_values(device).to(dtype),
                      video_grid_thw=prompt.video.grid_thw.to(device))  # fmt: skip
    return model(input_ids=seq, **kwargs).logits[0].float().cpu()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from worldserve.bench.reasoner_oracle import qwen3vl_oracle, reasoner_state
    from worldserve.bench.report import environment
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_step import reasoner_setup

    root, device, dtype, sync, _scratch = reasoner_setup(
        args.tiny, args.random_nano
    )  # (_scratch: tiny's folder)
    res: dict = {
        "environment": environment(device),
        "checkpoint": str(root),
        "dtype": str(dtype),
        "chats": {},
    }

    model = load_transformer(root, dtype=dtype, device=device, progress=False)
    tok = AutoTokenizer.from_pretrained(str(root / "text_tokenizer"))
    reasoner = Reasoner.from_pretrained(root, model, tok)
    reasoner.warm_up()
    pad_ids = (reasoner.image_token_id, reasoner.video_token_id)
    params = chats(args.tiny)
    for p in params.values():  # first calls (cuBLAS, the ViT's kernels at each shape) outside the timings
        ours(reasoner, p, sync)
    runs = {name: ours(reasoner, p, sync) for name, p in params.items()}
    del model, reasoner
    gc.collect()
    torch.cuda.empty_cache() if device.type == "cuda" else None

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # a float32 reference
    refs: dict[str, dict] = {name: {} for name in runs}
    state = reasoner_state(root)  # float32 on the host, read once for both oracles
    for odtype in dict.fromkeys((torch.float32, dtype)):  # once on the CPU (float32 both)
        t0 = time.perf_counter()
        oracle, result = qwen3vl_oracle(root, odtype, device, state)
        assert not result.missing_keys and not result.unexpected_keys
        print(f"oracle {odtype} built in {time.perf_counter() - t0:.0f} s", flush=True)
        for name, r in runs.items():
            refs[name][str(odtype)] = oracle_logits(oracle, r["prompt"], r["tokens"], pad_ids, device)
        del oracle
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None

    for name, r in runs.items():
        exact = refs[name][str(torch.float32)]
        same = refs[name][str(dtype)]
        n = len(r["prompt"].input_ids)
        row = {
            "prompt_tokens": n,
            "visual_tokens": sum(1 for t in r["prompt"].input_ids if t in pad_ids),
            "prefill_ms": 1000 * r["prefill_s"],
            "rel_err_ours_vs_fp32": rel(r["logits"], exact),
            "rel_err_transformers_same_dtype_vs_fp32": rel(same, exact),
            "top1_agree_ours": (r["logits"].argmax(-1) == exact.argmax(-1)).float().mean().item(),
            "top1_agree_transformers_same_dtype": (same.argmax(-1) == exact.argmax(-1)).float().mean().item(),
            "greedy_tokens_equal_fp32_argmax": exact[n - 1 : n - 1 + STEPS].argmax(-1).tolist()
            == r["tokens"],
        }
        if dtype != torch.float32:  # (in float32 both errors are rounding noise: no ratio)
            row["error_ratio"] = row["rel_err_ours_vs_fp32"] / row["rel_err_transformers_same_dtype_vs_fp32"]
        res["chats"][name] = row
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print("\n| chat | prompt tok (visual) | prefill ms | rel err ours / transformers (vs fp32) | ratio | "
          "top-1 agree ours / tf | greedy = fp32 |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, r in res["chats"].items():
        print(f"| {name} | {r['prompt_tokens']} ({r['visual_tokens']}) | {r['prefill_ms']:.0f} | "
              f"{r['rel_err_ours_vs_fp32']:.2e} / {r['rel_err_transformers_same_dtype_vs_fp32']:.2e} | "
              f"{r.get('error_ratio', float('nan')):.2f} | {r['top1_agree_ours']:.3f} / {r['top1_agree_transformers_same_dtype']:.3f} | "
              f"{r['greedy_tokens_equal_fp32_argmax']} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
