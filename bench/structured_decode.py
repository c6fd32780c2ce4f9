"""Structured outputs' cost on the Reasoner's decode, in process: B chats stepped together, free and under a JSON
schema, on the full-size Nano transformer with random bf16 weights (worldserve/bench/models.py) and the tiny
byte-level tokenizer (the real Qwen tokenizer cannot be downloaded here; its vocabulary is 116x larger, which
makes llguidance's masks costlier: see the README of bench/results).

Per batch size: seconds a step (Reasoner.step_all: sampling, detokenizing, the batched decode step) for the
free chats and the constrained ones, their ratio, and where the constrained step's extra host time goes:
`constrain_rows` (the grammars' masks computed, copied to the GPU and applied) and the sampler.
Every chat runs --steps tokens (ignore_eos; the schema's documents cannot close before 64 objects).

    PYTHONPATH=. python3 bench/structured_decode.py --out $OUT/structured_decode.json     # H200: ~1 min
    PYTHONPATH=. python3 bench/structured_decode.py --tiny --device cpu --out /tmp/s.json  # smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

SCHEMA = {"type": "object", "required": ["objects"], "properties": {"objects": {
    "type": "array", "minItems": 64, "items": {"type": "object", "required": ["name", "x", "y"], "properties": {
        "name": {"type": "string", "maxLength": 24}, "x": {"type": "number"}, "y": {"type": "number"}}}}}}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=96)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny config (CPU smoke test)")
    ap.add_argument("--profile", type=Path, help="write torch.profiler's table of 8 constrained steps here")
    return ap.parse_args(argv)


class Timer:
    """Host seconds spent in a wrapped function."""

    def __init__(self, fn):
        self.fn, self.s = fn, 0.0

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.s += time.perf_counter() - t0


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoTokenizer

    import worldserve.runner.chat_stepping as stepping_mod
    import worldserve.runner.reasoner as reasoner_mod
    from worldserve.bench.models import build_our_transformer
    from worldserve.bench.report import environment
    from worldserve.chat_params import StructuredOutput
    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.weights.tokenizer_fixture import write_tiny_tokenizer

    device = torch.device(args.device)
    cfg = Cosmos3Config.tiny(vocab_size=1287) if args.tiny else Cosmos3Config.nano()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    folder = Path(tempfile.mkdtemp()) / "tokenizer"
    write_tiny_tokenizer(folder)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = build_our_transformer(cfg, device, dtype, None, 0)
    model.set_attention_backend(None)
    batches = [int(b) for b in args.batches.split(",")]
    r = reasoner_mod.Reasoner(model, tok, None, image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                              max_model_len=4096, max_num_seqs=max(batches))  # fmt: skip
    r.warm_up()
    constrain, sample = Timer(stepping_mod.constrain_rows), Timer(stepping_mod.sample_tokens)
    stepping_mod.constrain_rows, stepping_mod.sample_tokens = constrain, sample
    so = StructuredOutput(kind="json", spec=json.dumps(SCHEMA))
    res: dict = {
        "environment": environment(device),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rows": [],
    }
    for b in batches:
        row: dict = {"batch": b}
        for label, structured in (("free", None), ("json_schema", so), ("free_again", None)):
            sessions = r.start_many(params_of(b, structured, args.steps))
            r.step_all(sessions)  # the first step (a new grammar compiles) outside the timing
            constrain.s = sample.s = 0.0
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0, steps = time.perf_counter(), 0
            while any(s.finish_reason is None for s in sessions):
                r.step_all([s for s in sessions if s.finish_reason is None])
                steps += 1
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            row[label] = {"step_ms": 1e3 * wall / steps, "constrain_rows_ms": 1e3 * constrain.s / steps,
                          "sample_ms": 1e3 * sample.s / steps, "tokens_s": b * steps / wall}  # fmt: skip
        row["ratio"] = row["free"]["step_ms"] / row["json_schema"]["step_ms"]
        if args.profile and b == max(batches):
            profile_steps(r, params_of(b, so, 16), args.profile)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    return res


def params_of(b: int, structured, steps: int) -> list:
    from worldserve.chat_params import ChatMessage, ChatParams

    return [ChatParams(messages=(ChatMessage(role="user", content=f"Describe scene {i}."),), seed=i,
                       max_tokens=steps, ignore_eos=True, structured=structured) for i in range(b)]  # fmt: skip


def profile_steps(r, params: list, out: Path) -> None:
    """torch.profiler's table (by host time) of 8 steps of `params`' chats, after 4 untimed ones."""
    from torch.profiler import ProfilerActivity, profile

    sessions = r.start_many(params)
    for _ in range(4):
        r.step_all(sessions)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            r.step_all(sessions)
        torch.cuda.synchronize()
    out.write_text(prof.key_averages().table(sort_by="cpu_time_total", row_limit=40))
    for s in sessions:
        s.close()


def table(res: dict) -> str:
    lines = [
        f"{'chats':>5s} {'free ms':>8s} {'json ms':>8s} {'again ms':>8s} {'ratio':>6s} {'masks ms':>8s} {'sample ms':>9s}"
    ]
    for row in res["rows"]:
        f, j, a = row["free"], row["json_schema"], row["free_again"]
        lines.append(f"{row['batch']:5d} {f['step_ms']:8.2f} {j['step_ms']:8.2f} {a['step_ms']:8.2f} "
                     f"{row['ratio']:6.3f} {j['constrain_rows_ms']:8.2f} {j['sample_ms']:9.2f}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
