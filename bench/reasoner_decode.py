"""Reasoner decode speed on one GPU: the und tower eager against compiled (its single-token path), same weights.

Builds the full-size Cosmos3-Nano transformer with random bf16 weights (worldserve/bench/models.py), picks the
attention kernel as the product does, and times (worldserve/bench/und_decode.py) one batched decode step
(B chats of --context tokens, one new token each, + lm_head) for each --batches entry, and a prompt prefill
of --prefill tokens, eagerly and after `compile_und_layers()` (the product default on CUDA). The two
variants alternate over --rounds rounds and each keeps its fastest round: the decode step is host-bound, and
two runs that measured all of eager first and then all of compiled saw batched steps slow down in the second
half even where both ran the same eager code (bench/results/README.md).
Also the relative L2 of the compiled decode logits against eager on the same caches. Prints ms a step,
tokens/s and the ratio to the batch-1 weight-streaming roofline (performance.md: 284 tok/s; vLLM publishes
174 tok/s on an H200). Writes JSON to --out (a .json file or a folder).

    PYTHONPATH=. python bench/reasoner_decode.py --out $OUT                      # H200: ~2 min
    PYTHONPATH=. python bench/reasoner_decode.py --tiny --device cpu --out /tmp/x  # smoke test
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

ROOFLINE_TOK_S = 284.0  # performance.md §1: 15.1 GB of weights a token at 4.3 TB/s
VLLM_TOK_S = 174.0  # performance.md: vLLM's published Cosmos3-Nano Reasoner decode, batch 1, H200


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file (or folder for reasoner-decode-<stamp>.json)")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes (chats decoded together)")
    ap.add_argument("--context", type=int, default=300, help="tokens already in each chat's cache")
    ap.add_argument("--prefill", type=int, default=3500, help="tokens of the timed prompt prefill")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager for CPU smoke)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating eager / compiled rounds")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    return ap.parse_args(argv)


def prefill_seconds(model, device, tokens: int) -> float:
    from worldserve.bench.timing import time_region

    ids = torch.arange(tokens, device=device) % model.config.vocab_size
    return time_region(lambda: model.prefill_und([ids]), device, warmup=1, repeats=3).median


def decode_logits(model, device) -> torch.Tensor:
    """Logits of a decode step of 2 chats, then of the first alone (the compiled single-token path), on fixed
    prompts: the numerics check."""
    from worldserve.models.cosmos3.batch import UndBatch

    vocab = model.config.vocab_size
    caches = [model.new_und_cache(64) for _ in range(2)]
    prompts = [torch.arange(40, device=device) % vocab, (torch.arange(33, device=device) * 3) % vocab]
    model.und_step(UndBatch.text(prompts), caches, kv_only=True)
    ids = [torch.tensor([11], device=device), torch.tensor([12], device=device)]
    both = model.compute_logits(model.und_step(UndBatch.text(ids, starts=[40, 33]), caches))
    alone = model.compute_logits(model.und_step(UndBatch.text(ids[:1], starts=[41]), caches[:1]))
    return torch.cat([both, alone]).float()


def measure(model, device, args, log, label: str) -> dict:
    from worldserve.bench.und_decode import und_decode_seconds

    out: dict = {"decode": {}}
    for b in (int(x) for x in args.batches.split(",")):
        log(f"{label}: decode step, batch {b}")
        s = und_decode_seconds(model, device, batch=b, context=args.context)
        out["decode"][str(b)] = {"step_s": s, "tok_s": b / s}
    log(f"{label}: prefill of {args.prefill} tokens")
    out["prefill_s"] = prefill_seconds(model, device, args.prefill)
    return out


def fastest(rounds: list[dict]) -> dict:
    """Per batch size (and for the prefill) the fastest of the rounds."""
    decode = {}
    for b in rounds[0]["decode"]:
        decode[b] = min((r["decode"][b] for r in rounds), key=lambda x: x["step_s"])
    return {"decode": decode, "prefill_s": min(r["prefill_s"] for r in rounds), "rounds": rounds}


def set_und_fns(model, fns: tuple) -> None:
    for layer in model.layers:
        layer.und.qkv_fn, layer.und.finish_fn = fns


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    from worldserve.bench.denoise import rel_error
    from worldserve.bench.models import build_our_transformer
    from worldserve.bench.report import environment
    from worldserve.models.cosmos3.config import Cosmos3Config

    device = torch.device(args.device)
    cfg = Cosmos3Config.tiny() if args.tiny else Cosmos3Config.nano()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res: dict = {"environment": environment(device), "args": vars(args)}
    t0 = time.perf_counter()
    model = build_our_transformer(cfg, device, dtype, None, args.seed)
    res["attention"] = model.set_attention_backend(None)
    blk = model.layers[0].und
    eager_fns = (blk.qkv_fn, blk.finish_fn)
    model.compile_und_layers(backend=args.backend)
    variants = {"eager": eager_fns, "compiled": (blk.qkv_fn, blk.finish_fn)}
    logits, rounds = {}, {name: [] for name in variants}
    for r in range(args.rounds):
        for name, fns in variants.items():
            set_und_fns(model, fns)
            rounds[name].append(measure(model, device, args, log, f"round {r + 1} {name}"))
            logits[name] = decode_logits(model, device)
        save({**res, "rounds": rounds})
    for name in variants:
        res[name] = fastest(rounds[name])
    res["logits_rel_error"] = rel_error(logits["compiled"], logits["eager"])
    res["wall_s"] = time.perf_counter() - t0
    return res


def table(res: dict) -> str:
    env = res["environment"]
    lines = [
        f"Reasoner decode (und tower + lm_head), {env.get('gpu', env['device'])}, attention {res['attention']}, "
        f"context {res['args']['context']} tokens",
        f"{'batch':>5s} {'eager ms':>9s} {'compiled ms':>11s} {'speed-up':>8s} {'tok/s':>8s} {'of roofline':>11s}",
    ]
    for b, e in res["eager"]["decode"].items():
        c = res["compiled"]["decode"][b]
        lines.append(
            f"{b:>5s} {e['step_s'] * 1e3:9.2f} {c['step_s'] * 1e3:11.2f} {e['step_s'] / c['step_s']:7.2f}x "
            f"{c['tok_s']:8.1f} {c['tok_s'] / ROOFLINE_TOK_S if b == '1' else float('nan'):11.2f}"
        )
    e, c = res["eager"]["prefill_s"], res["compiled"]["prefill_s"]
    lines += [
        f"prefill {res['args']['prefill']} tokens: eager {e:.4f} s, compiled {c:.4f} s ({e / c:.2f}x)",
        f"compiled vs eager decode logits, rel. L2: {res['logits_rel_error']:.2e}; "
        f"roofline {ROOFLINE_TOK_S:.0f} tok/s, vLLM {VLLM_TOK_S:.0f} tok/s at batch 1",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "reasoner-decode")


if __name__ == "__main__":
    sys.exit(main())
