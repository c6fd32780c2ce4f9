"""The Reasoner's prefix cache at full size: time to the first token's logits with and without it, same run.

Loads a random full-size Cosmos3-Nano (bench/parallel_step.py writes it once, with its Qwen3-VL ViT and the
tiny byte tokenizer) into two Reasoners over the same transformer, one with prefix caching (the serve
default) and one without (`--no-enable-prefix-caching`). Per scenario, a first chat fills the cache, then
a second chat that shares its prefix is started on each Reasoner (best of --rounds, each round's second chat
ending differently, so that it finds the shared prefix cached and not itself): `start()` of a prompt built
beforehand (as the API builds it, in its own thread) runs the prefill (the ViT included) and the LM head, so
its time is the in-process time to the first token. Scenarios: a long system prompt with another
question; the same 720p image with another question; a next turn that repeats a 2k-token prompt and its
128-token answer. Also the first token's logits against the uncached Reasoner's (relative L2, bf16) and
whether the greedy tokens of the next --steps steps agree.

    PYTHONPATH=. python bench/prefix_cache.py --random-nano /tmp/nano-random --out $OUT/prefix_cache.json
    PYTHONPATH=. python bench/prefix_cache.py --tiny --out /tmp/prefix_cache.json    # CPU smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_step import reasoner_bench_parser

    ap = reasoner_bench_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8, help="greedy steps compared after the first token")
    return ap.parse_args(argv)


def scenarios(tiny: bool) -> dict:
    """name -> (first chat, second chat sharing its prefix)."""
    from worldserve.chat_params import ChatMessage, ChatParams, ChatPart

    system = "You are a meticulous assistant for world-model video generation. " * (4 if tiny else 30)
    h, w = (64, 96) if tiny else (720, 1280)
    image = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)

    def chat(*parts, sys_text=None):
        msgs = [ChatMessage(role="system", content=sys_text)] if sys_text else []
        content = tuple(ChatPart(type="text", text=p) if isinstance(p, str) else ChatPart(type="image", image=p)
                        for p in parts)  # fmt: skip
        return ChatParams(messages=(*msgs, ChatMessage(role="user", content=content)), temperature=0.0)

    return {
        "system_prompt": (
            chat("Describe a fox.", sys_text=system),
            chat("Describe a hare.", sys_text=system),
        ),
        "image_720p": (chat(image, "What is in this picture?"), chat(image, "Which colours dominate?")),
        "next_turn": None,  # built from the first chat's answer (run())
    }


def variant(params, r: int, shared: int = 0):
    """`params` as round r's chat: changed where it starts to differ from the first chat (the start of its last
    text part; for a raw prompt, token `shared`), so that every round shares exactly the first chat's prefix
    with the chats before it."""
    import dataclasses

    from worldserve.chat_params import ChatPart

    if params.prompt_ids is not None:
        ids = params.prompt_ids
        return dataclasses.replace(params, prompt_ids=ids[:shared] + (97 + r,) + ids[shared:])
    last = params.messages[-1]
    parts = (*last.content[:-1], ChatPart(type="text", text=f"({r}) {last.content[-1].text}"))
    return dataclasses.replace(
        params, messages=(*params.messages[:-1], dataclasses.replace(last, content=parts))
    )


def timed_start(reasoner, params, sync) -> tuple[float, object]:
    sync()
    t0 = time.perf_counter()
    session = reasoner.start(params)
    sync()
    return time.perf_counter() - t0, session


def greedy(session, steps: int) -> list[int]:
    for _ in range(steps):
        if session.finish_reason is not None:
            break
        session.step()
    session.close()
    return session.token_ids


def run(args: argparse.Namespace) -> dict:
    import dataclasses

    from transformers import AutoTokenizer

    from worldserve.bench.report import environment
    from worldserve.chat_params import ChatParams
    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    sys.path.insert(0, str(Path(__file__).parent))
    from parallel_step import reasoner_setup

    root, device, dtype, sync, _scratch = reasoner_setup(
        args.tiny, args.random_nano
    )  # (_scratch: tiny's folder)
    model = load_transformer(root, dtype=dtype, device=device, progress=False)
    tok = AutoTokenizer.from_pretrained(str(root / "text_tokenizer"))
    cached = Reasoner.from_pretrained(root, model, tok, kv_cache_tokens=65536)
    plain = Reasoner.from_pretrained(root, model, tok, kv_cache_tokens=65536, enable_prefix_caching=False)
    for r in (cached, plain):
        r.warm_up()
    res: dict = {"environment": environment(device), "command": " ".join(sys.argv), "dtype": str(dtype),
                 "scenarios": {}}  # fmt: skip
    pairs = scenarios(args.tiny)
    prompt_ids = tuple(cached.build_prompt(pairs["system_prompt"][0]).input_ids) * (1 if args.tiny else 2)
    first = ChatParams(  # (allowed ids: a random model's picks, kept inside the byte tokenizer's vocabulary)
        prompt_ids=prompt_ids, max_tokens=16 if args.tiny else 128, temperature=0.0, ignore_eos=True,
        allowed_token_ids=tuple(range(256)),
    )  # fmt: skip
    answer = greedy(cached.start(first), first.max_tokens)  # its blocks stay cached (prompt + answer)
    nxt = ChatParams(prompt_ids=prompt_ids + tuple(answer) + tuple(prompt_ids[:40]), temperature=0.0)
    pairs["next_turn"] = (first, nxt)
    for name, (a, b) in pairs.items():
        if name != "next_turn":
            greedy(cached.start(a), 1)  # fills the cache
        shared = len(prompt_ids) + len(answer) if name == "next_turn" else 0
        for r in (cached, plain):  # first calls of the shape (kernels, the ViT) outside the timings
            greedy(r.start(dataclasses.replace(variant(b, 99, shared), max_tokens=1)), 0)
        hits = cached.prefix_cache_counts[1]
        times = {"cached": [], "plain": []}
        outs = {}
        for i in range(args.rounds):
            for label, r in (("cached", cached), ("plain", plain)):
                params = dataclasses.replace(variant(b, i, shared), max_tokens=args.steps + 1)
                # built beforehand, as the API builds it in its own thread (template, tokens, image patches)
                t, s = timed_start(r, dataclasses.replace(params, prebuilt=r.build_prompt(params)), sync)
                times[label].append(t)
                outs[label] = (s.pending_logits.float().cpu(), greedy(s, args.steps + 1))
        (lc, tc), (lp, tp) = outs["cached"], outs["plain"]
        n = len(cached.build_prompt(variant(b, 0, shared)).input_ids)
        found = (cached.prefix_cache_counts[1] - hits) // args.rounds
        res["scenarios"][name] = {
            "prompt_tokens": n, "cached_tokens": found,
            "first_token_ms_cached": 1000 * min(times["cached"]), "first_token_ms_plain": 1000 * min(times["plain"]),
            "speedup": min(times["plain"]) / min(times["cached"]),
            "first_logits_rel_l2": ((lc - lp).norm() / lp.norm()).item(),
            "greedy_tokens_equal": tc == tp, "greedy_tokens_agreeing": sum(x == y for x, y in zip(tc, tp, strict=False)),
        }  # fmt: skip
    return res


def table(res: dict) -> str:
    rows = ["| scenario | prompt tokens | cached | first token cached ms | uncached ms | speed-up | logits rel L2 "
            "| greedy tokens equal |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, s in res["scenarios"].items():
        rows.append(f"| {name} | {s['prompt_tokens']} | {s['cached_tokens']} | {s['first_token_ms_cached']:.1f} | "
                    f"{s['first_token_ms_plain']:.1f} | {s['speedup']:.2f}x | {s['first_logits_rel_l2']:.2e} | "
                    f"{s['greedy_tokens_equal']} ({s['greedy_tokens_agreeing']}) |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # (puts bench/ on the path)
    from parallel_step import reasoner_bench_main

    return reasoner_bench_main(args, run, table)


if __name__ == "__main__":
    raise SystemExit(main())
