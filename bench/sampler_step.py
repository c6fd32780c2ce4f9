"""The Reasoner's batched sampler alone on one GPU: ms a step at batch 1 / 8 / 32, this tree against a baseline.

Times `sample_tokens` (sampling/tokens.py) over Cosmos3-Nano's 151,936-token vocabulary with fresh random logits
each step, for NVIDIA's suggested sampling (temperature 0.7, top_p 0.8, top_k 20, presence_penalty 1.5), greedy,
and the suggested sampling with `allowed_token_ids` (26 ids), each chat carrying a 200-token output so far.
`--baseline FILE` loads another version of sampling/tokens.py (e.g. `git show REV:worldserve/sampling/tokens.py
> /tmp/old_tokens.py`) and times it on the same logits in the same process, alternating rounds; the table gives
both and their ratio. The wall time of a step is the host's (launches and the one sync), what the chat worker
spends on sampling between two decode steps.

    PYTHONPATH=. python bench/sampler_step.py --baseline /tmp/old_tokens.py --out $OUT/sampler_step.json
    PYTHONPATH=. python bench/sampler_step.py --device cpu --steps 5 --out /tmp/sampler.json   # smoke test
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time

import torch

from worldserve.bench.report import environment
from worldserve.sampling import tokens as current

VOCAB = 151_936
SUGGESTED = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "presence_penalty": 1.5}
CASES = {
    "suggested": SUGGESTED,
    "greedy": {"temperature": 0.0},
    "allowed_ids": {**SUGGESTED, "allowed_token_ids": tuple(range(1000, 1026))},
}


def load(path: str):
    spec = importlib.util.spec_from_file_location("baseline_tokens", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def time_steps(module, case: dict, batch: int, logits: list[torch.Tensor]) -> float:
    """Median ms of one sample_tokens call over `logits` (one [B, V] tensor a step)."""
    samplers = [module.TokenSampler(**case, seed=i) for i in range(batch)]
    for i, s in enumerate(samplers):  # a 200-token output so far
        for t in range(200):
            s.record((t * 7919 + i * 97) % VOCAB)
    module.sample_tokens(samplers, logits[0])  # warm-up: device counts built
    times = []
    for x in logits:
        t0 = time.perf_counter()
        module.sample_tokens(samplers, x)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--baseline", help="another sampling/tokens.py to time beside this tree's")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    versions = {"this tree": current} | ({"baseline": load(args.baseline)} if args.baseline else {})
    g = torch.Generator(device=device).manual_seed(0)
    res: dict = {"environment": environment(device), "command": " ".join(sys.argv), "vocab": VOCAB, "ms": {}}
    for name, case in CASES.items():
        for b in (int(x) for x in args.batches.split(",")):
            logits = [torch.randn(b, VOCAB, generator=g, device=device, dtype=torch.bfloat16) * 3
                      for _ in range(args.steps)]  # fmt: skip
            rounds = [
                {v: time_steps(m, case, b, logits) for v, m in versions.items()} for _ in range(args.rounds)
            ]
            best = {v: min(r[v] for r in rounds) for v in versions}  # the versions alternate round by round
            res["ms"][f"{name}/{b}"] = best
    print(
        f"{'case':>12s} {'batch':>5s} "
        + " ".join(f"{v:>10s}" for v in versions)
        + ("  ratio" if args.baseline else "")
    )
    for key, best in res["ms"].items():
        name, b = key.split("/")
        ratio = f"  {best['baseline'] / best['this tree']:.2f}x" if args.baseline else ""
        print(f"{name:>12s} {b:>5s} " + " ".join(f"{best[v]:10.3f}" for v in versions) + ratio)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
