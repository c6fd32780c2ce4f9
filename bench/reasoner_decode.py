"""Reasoner decode speed on one GPU: the paged, compiled, CUDA-graphed decode step against eager, same weights.

Builds the full-size Cosmos3-Nano transformer with random bf16 weights (worldserve/bench/models.py), picks the
attention kernel as the product does, and times (worldserve/bench/und_decode.py) one batched decode step
(B chats of --context tokens, one new token each, + lm_head) for each --batches entry, three ways:
- `contiguous`: und_step over one contiguous cache per chat, eager (the Reasoner's path before this decoder);
- `eager`: the paged decoder (runner/und_decoder.py) run eagerly (`--enforce-eager`);
- `graphed`: the paged decoder compiled and captured in CUDA graphs (the serve default on a GPU).
The variants alternate over --rounds rounds and each keeps its fastest round (the eager steps are host-bound
and noisy). Also the prefill of --prefill tokens, and the decode logits of graphed and eager against the
contiguous path on the same prompts (relative L2). Prints ms a step, tokens/s and the ratio to the batch-1
weight-streaming roofline (performance.md: 284 tok/s; vLLM publishes 174 tok/s on an H200). JSON to --out.

    PYTHONPATH=. python bench/reasoner_decode.py --out $OUT                      # H200: ~3 min
    PYTHONPATH=. python bench/reasoner_decode.py --tiny --device cpu --out /tmp/x  # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

ROOFLINE_TOK_S = 284.0  # performance.md §1: 15.1 GB of weights a token at 4.3 TB/s
VLLM_TOK_S = 174.0  # performance.md: vLLM's published Cosmos3-Nano Reasoner decode, batch 1, H200
VARIANTS = ("contiguous", "eager", "graphed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file (or folder for reasoner-decode-<stamp>.json)")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes (chats decoded together)")
    ap.add_argument("--context", type=int, default=300, help="tokens already in each chat's cache")
    ap.add_argument("--prefill", type=int, default=3500, help="tokens of the timed prompt prefill")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds alternating the three variants")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    return ap.parse_args(argv)


def decode_logits(model, device, decoder) -> torch.Tensor:
    """Logits of two decode steps (2 chats, then the first alone) on fixed prompts, through `decoder`, or
    through und_step over contiguous caches when it is None: the numerics check."""
    from worldserve.models.cosmos3.batch import UndBatch

    vocab = model.config.vocab_size
    prompts = [torch.arange(40, device=device) % vocab, (torch.arange(33, device=device) * 3) % vocab]
    if decoder is None:
        caches = [model.new_und_cache(64) for _ in prompts]
    else:
        caches = [decoder.pool.sequence() for _ in prompts]
        for c, p in zip(caches, prompts, strict=True):
            c.reserve(len(p) + 2)
    model.und_step(UndBatch.text(prompts), caches, kv_only=True)
    if decoder is None:
        ids = [torch.tensor([11], device=device), torch.tensor([12], device=device)]
        both = model.compute_logits(model.und_step(UndBatch.text(ids, starts=[40, 33]), caches))
        alone = model.compute_logits(model.und_step(UndBatch.text(ids[:1], starts=[41]), caches[:1]))
    else:
        both = decoder.step([11, 12], caches, [40, 33])
        alone = decoder.step([11], caches[:1], [41])
        for c in caches:
            c.release()
    return torch.cat([both, alone]).float()


def measure(model, device, args, log, name: str, decoder, label: str) -> dict:
    from worldserve.bench.und_decode import contiguous_decode_seconds, und_decode_seconds

    out: dict = {"decode": {}}
    for b in (int(x) for x in args.batches.split(",")):
        log(f"{label}: decode step, batch {b}")
        if decoder is None:
            s = contiguous_decode_seconds(model, device, batch=b, context=args.context)
        else:
            s = und_decode_seconds(model, device, decoder, batch=b, context=args.context)
        out["decode"][str(b)] = {"step_s": s, "tok_s": b / s}
    return out


def sampling_ms(device: torch.device, batch: int, vocab: int) -> float:
    """ms of one batched sample_tokens call over [batch, vocab] bf16 logits with NVIDIA's suggested chat
    settings (temperature 0.7, top_p 0.8, top_k 20, presence_penalty 1.5), each row its own seeded sampler."""
    from worldserve.bench.timing import time_region
    from worldserve.sampling.tokens import TokenSampler, sample_tokens

    logits = torch.randn(batch, vocab, device=device).to(torch.bfloat16)
    samplers = [TokenSampler(temperature=0.7, top_p=0.8, top_k=20, presence_penalty=1.5, seed=i)
                for i in range(batch)]  # fmt: skip
    return time_region(lambda: sample_tokens(samplers, logits), device, warmup=2, repeats=5).median * 1e3


def fastest(rounds: list[dict]) -> dict:
    """Per batch size the fastest of the rounds."""
    decode = {}
    for b in rounds[0]["decode"]:
        decode[b] = min((r["decode"][b] for r in rounds), key=lambda x: x["step_s"])
    return {"decode": decode, "rounds": rounds}


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    from worldserve.bench.denoise import rel_error
    from worldserve.bench.models import build_our_transformer
    from worldserve.bench.report import environment
    from worldserve.bench.timing import time_region
    from worldserve.bench.und_decode import make_decoder
    from worldserve.models.cosmos3.config import Cosmos3Config

    device = torch.device(args.device)
    cfg = Cosmos3Config.tiny() if args.tiny else Cosmos3Config.nano()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res: dict = {"environment": environment(device), "args": vars(args)}
    t0 = time.perf_counter()
    model = build_our_transformer(cfg, device, dtype, None, args.seed)
    res["attention"] = model.set_attention_backend(None)
    batches = [int(x) for x in args.batches.split(",")]
    tokens = max(batches) * 64 * -(-(args.context + 16) // 64)  # whole 64-token blocks per chat
    decoders = {
        "contiguous": None,
        "eager": make_decoder(model, max_batch=max(batches), tokens=tokens, enforce_eager=True),
        "graphed": make_decoder(model, max_batch=max(batches), tokens=tokens),
    }
    t1 = time.perf_counter()
    decoders["graphed"].capture_all()
    res["capture_s"] = time.perf_counter() - t1
    log(
        f"decode step compiled and captured for batches {decoders['graphed'].buckets} in {res['capture_s']:.1f} s"
    )
    rounds = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        for name in VARIANTS:
            rounds[name].append(
                measure(model, device, args, log, name, decoders[name], f"round {r + 1} {name}")
            )
        save({**res, "rounds": rounds})
    for name in VARIANTS:
        res[name] = fastest(rounds[name])
    ids = torch.arange(args.prefill, device=device) % cfg.vocab_size
    res["prefill_s"] = time_region(lambda: model.prefill_und([ids]), device, warmup=1, repeats=3).median
    logits = {name: decode_logits(model, device, decoders[name]) for name in VARIANTS}
    res["logits_rel_error"] = {n: rel_error(logits[n], logits["contiguous"]) for n in ("eager", "graphed")}
    res["sampling_ms"] = {str(b): sampling_ms(device, b, cfg.vocab_size) for b in batches}
    res["sampling_ms_host_row"] = sampling_ms(torch.device("cpu"), 1, cfg.vocab_size)  # the pre-batched way
    res["wall_s"] = time.perf_counter() - t0
    return res


def table(res: dict) -> str:
    env = res["environment"]
    lines = [
        f"Reasoner decode (und tower + lm_head), {env.get('gpu', env['device'])}, attention {res['attention']}, "
        f"context {res['args']['context']} tokens",
        f"{'batch':>5s} {'contiguous ms':>13s} {'eager ms':>9s} {'graphed ms':>10s} {'speed-up':>8s} "
        f"{'tok/s':>8s} {'of roofline':>11s} {'sampling ms':>11s}",
    ]
    for b, c in res["contiguous"]["decode"].items():
        e, g = res["eager"]["decode"][b], res["graphed"]["decode"][b]
        lines.append(
            f"{b:>5s} {c['step_s'] * 1e3:13.2f} {e['step_s'] * 1e3:9.2f} {g['step_s'] * 1e3:10.2f} "
            f"{c['step_s'] / g['step_s']:7.2f}x {g['tok_s']:8.1f} "
            f"{g['tok_s'] / ROOFLINE_TOK_S if b == '1' else float('nan'):11.2f} {res['sampling_ms'][b]:11.2f}"
        )
    err = res["logits_rel_error"]
    lines += [
        f"prefill {res['args']['prefill']} tokens: {res['prefill_s']:.4f} s; capture {res['capture_s']:.1f} s; "
        f"one row sampled on the host (the pre-batched way): {res['sampling_ms_host_row']:.2f} ms",
        f"decode logits vs contiguous, rel. L2: eager {err['eager']:.2e}, graphed {err['graphed']:.2e}; "
        f"roofline {ROOFLINE_TOK_S:.0f} tok/s, vLLM {VLLM_TOK_S:.0f} tok/s at batch 1",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "reasoner-decode")


if __name__ == "__main__":
    sys.exit(main())
