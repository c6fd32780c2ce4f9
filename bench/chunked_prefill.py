"""Chunked prefill at full size: what a long prompt arriving costs the chats already decoding, chunked or not.

Loads a random full-size Cosmos3-Nano (bench/parallel_step.py writes it once) into two Reasoners over the same
transformer, prefix caching off in both: `chunked` (serve's default: a prompt longer than
--max-num-batched-tokens is prefilled a chunk a step, between the running chats' decode steps) and `whole`
(`--no-enable-chunked-prefill`). For each, --chats greedy chats decode for a few steps, then a --long-token
prompt arrives: it is admitted (start_many, as the chat worker admits it) and every session is stepped together
(step_all, as the chat worker steps them) until the long chat has its first token. Reported, per variant:
the running chats' inter-token gaps over that window (the iteration times, the admission's iteration being its
pass and the step after it, which share one token budget: max and median), the long chat's time to its first
token, and the steps it took. Chunking trades a little of the long chat's first-token time for
gaps bounded by one chunk's prefill.

    PYTHONPATH=. python bench/chunked_prefill.py --random-nano /tmp/nano-random --out $OUT/chunked_prefill.json
    PYTHONPATH=. python bench/chunked_prefill.py --tiny --out /tmp/chunked_prefill.json    # CPU smoke test
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_step import reasoner_bench_parser

    ap = reasoner_bench_parser(__doc__)
    ap.add_argument("--long", type=int, default=16384, help="tokens of the prompt that arrives")
    ap.add_argument("--chats", type=int, default=8, help="chats decoding when it arrives")
    ap.add_argument(
        "--budget", type=int, default=8192, help="--max-num-batched-tokens of the chunked variant"
    )
    ap.add_argument("--rounds", type=int, default=2, help="best round kept (the long chat's first token)")
    return ap.parse_args(argv)


def window(reasoner, chats: int, long: int, sync) -> dict:
    """One round: `chats` decoding, the long prompt admitted, steps until its first token."""
    from worldserve.chat_params import ChatParams

    running = [
        reasoner.start(ChatParams(prompt_ids=tuple(range(3 + i, 103 + i)), max_tokens=4096, temperature=0.0,
                                  ignore_eos=True))
        for i in range(chats)
    ]  # fmt: skip
    for _ in range(3):
        reasoner.step_all(running)
    params = ChatParams(
        prompt_ids=tuple(3 + (i * 7) % 250 for i in range(long)), max_tokens=2, temperature=0.0
    )
    sync()
    t0 = time.perf_counter()
    (late,) = reasoner.start_many([params])
    gaps, steps, t = [], 0, t0  # the admission's pass and the step after it: one iteration, one gap
    while late.completion_tokens == 0:
        reasoner.step_all([*running, late])
        sync()
        gaps.append(time.perf_counter() - t)
        t = time.perf_counter()
        steps += 1
    ttft = time.perf_counter() - t0
    for s in (*running, late):
        s.close()
    return {"max_gap_ms": 1000 * max(gaps), "median_gap_ms": 1000 * statistics.median(gaps),
            "first_token_ms": 1000 * ttft, "steps": steps}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    from worldserve.bench.report import environment
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_step import reasoner_setup

    root, device, dtype, sync, _scratch = reasoner_setup(args.tiny, args.random_nano)  # (_scratch: tiny's)
    model = load_transformer(root, dtype=dtype, device=device, progress=False)
    attention = model.set_attention_backend(None)  # serve's default: FA3 where it runs, else SDPA
    tok = AutoTokenizer.from_pretrained(str(root / "text_tokenizer"))
    opts = {"kv_cache_tokens": 2 * 32768, "max_model_len": 32768, "enable_prefix_caching": False,
            "max_num_batched_tokens": args.budget}  # fmt: skip
    variants = {
        "chunked": Reasoner.from_pretrained(root, model, tok, **opts),
        "whole": Reasoner.from_pretrained(root, model, tok, enable_chunked_prefill=False, **opts),
    }
    for r in variants.values():
        r.warm_up()
    res: dict = {"environment": environment(device), "command": " ".join(sys.argv), "dtype": str(dtype),
                 "attention": attention, "long_prompt_tokens": args.long, "running_chats": args.chats, "budget": args.budget,
                 "variants": {}}  # fmt: skip
    for label, r in variants.items():
        rounds = [window(r, args.chats, args.long, sync) for _ in range(args.rounds)]
        res["variants"][label] = {**min(rounds, key=lambda x: x["first_token_ms"]), "rounds": rounds}
    return res


def table(res: dict) -> str:
    rows = [f"long prompt {res['long_prompt_tokens']} tokens, {res['running_chats']} chats decoding, budget "
            f"{res['budget']}, attention {res['attention']}", "| variant | running chats' max gap ms | median gap ms | long chat's first token ms "
            "| steps |", "|---|---|---|---|---|"]  # fmt: skip
    for label, v in res["variants"].items():
        rows.append(f"| {label} | {v['max_gap_ms']:.1f} | {v['median_gap_ms']:.1f} | {v['first_token_ms']:.1f} | "
                    f"{v['steps']} |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # (puts bench/ on the path)
    from parallel_step import reasoner_bench_main

    return reasoner_bench_main(args, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
