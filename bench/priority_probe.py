"""Do kernels on a high-priority stream get SMs while a long kernel runs on a normal one? Chats beside video.

A chat's decode kernels run on a high-priority stream beside the video's (runner/chat_share.py). They get
SMs only where the GPU hands them some: as the video kernel's CTAs retire (a non-persistent kernel), or in
the SMs a persistent kernel leaves free (FA3's `sm_margin`). This probe takes the GIL and the host out of
it: one thread queues ~1.5 s of one background kernel on the default stream, then launches, every few
milliseconds, a chain of small GEMMs ([rows, 4096] @ [4096, 4096] bf16, a decode step's shape) on a
priority-(-1) stream between two timing events; the chain's GPU time beside the background, against the
same chain on an idle GPU, says how long the priority stream waited for SMs. Backgrounds:
- `fa4-cluster`: the gen tower's FA4 kernel (2-CTA clusters, not persistent; models/layers/fa4_cluster.py);
- `fa3-m0` / `fa3-m16`: FA3 (persistent) with sm_margin 0 / 16;
- `gemm`: a cuBLAS 8192^3 bf16 product (not persistent).
Attention at the gen shape: 44,357 queries over 44,657 keys, GQA 32 / 8, d 128 (bench/sustained_rate.py's).

    PYTHONPATH=. python bench/priority_probe.py --out $OUT/priority_probe.json      # H200: ~30 s
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

BACKGROUNDS = ("fa4-cluster", "fa3-m0", "fa3-m16", "gemm")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file (or folder for priority-probe-<stamp>.json)")
    ap.add_argument("--backgrounds", default=",".join(BACKGROUNDS), help="comma-separated subset")
    ap.add_argument("--chain", type=int, default=20, help="small GEMMs in one timed chain")
    ap.add_argument("--rows", type=int, default=8, help="rows of each small GEMM (decode batch)")
    ap.add_argument("--probes", type=int, default=40, help="timed chains per background")
    ap.add_argument("--seconds", type=float, default=1.5, help="background queued per run")
    return ap.parse_args(argv)


def _background(name: str, device: torch.device):
    """(call, seconds a call) of one background kernel."""
    from worldserve.bench.timing import time_region
    from worldserve.models.layers.flash_attention import fa3_attention, set_fa3_sm_margin

    if name == "gemm":
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        out = torch.empty_like(a)

        def call():
            torch.mm(a, b, out=out)
    else:
        g = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(44357, 32, 128, device=device, dtype=torch.bfloat16, generator=g)
        k = torch.randn(44657, 8, 128, device=device, dtype=torch.bfloat16, generator=g)
        v = torch.randn(44657, 8, 128, device=device, dtype=torch.bfloat16, generator=g)
        o = torch.empty_like(q)
        if name == "fa4-cluster":
            from worldserve.models.layers.fa4_cluster import fa4_cluster_attention

            def call():
                fa4_cluster_attention(q, k, v, out=o)
        else:
            set_fa3_sm_margin(int(name.removeprefix("fa3-m")))

            def call():
                fa3_attention(q, k, v, out=o)

    return call, time_region(call, device, warmup=2, repeats=3).median


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    from worldserve.bench.report import environment
    from worldserve.models.layers.flash_attention import set_fa3_sm_margin

    device = torch.device("cuda")
    res: dict = {"environment": environment(device), "args": vars(args), "runs": {}}
    hp = torch.cuda.Stream(device, priority=-1)
    x = torch.randn(args.rows, 4096, device=device, dtype=torch.bfloat16)
    w = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)

    def probe() -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(hp):
            start.record(hp)
            for _ in range(args.chain):
                torch.mm(x, w)
            end.record(hp)
        return start, end

    def chains(gap_s: float) -> list[float]:
        events = []
        for _ in range(args.probes):
            events.append(probe())
            time.sleep(gap_s)
        torch.cuda.synchronize(device)
        return [s.elapsed_time(e) for s, e in events]

    alone = chains(0.002)
    res["chain_alone_ms"] = statistics.median(alone)
    log(f"chain of {args.chain} GEMMs alone: {res['chain_alone_ms']:.3f} ms")
    for name in args.backgrounds.split(","):
        call, seconds = _background(name, device)
        calls = max(2, round(args.seconds / seconds))
        torch.cuda.synchronize(device)
        for _ in range(calls):  # queued at once: the host is free to launch probes
            call()
        t = chains(max(0.0005, 0.8 * args.seconds / args.probes))  # (returns after a device sync)
        set_fa3_sm_margin(0)
        t.sort()
        run_ = {"call_ms": seconds * 1e3, "calls": calls, "chain_ms_median": statistics.median(t),
                "chain_ms_p90": t[int(0.9 * (len(t) - 1))], "chain_ms_max": t[-1]}  # fmt: skip
        res["runs"][name] = run_
        log(f"{name}: {run_}")
        save(res)
    return res


def table(res: dict) -> str:
    lines = [
        f"high-priority chain of {res['args']['chain']} GEMMs ({res['args']['rows']} x 4096 @ 4096 x 4096): "
        f"{res['chain_alone_ms']:.3f} ms alone",
        f"{'background':>12s} {'call ms':>8s} {'median ms':>10s} {'p90 ms':>8s} {'max ms':>8s} {'x alone':>8s}",
    ]
    for name, r in res["runs"].items():
        lines.append(
            f"{name:>12s} {r['call_ms']:8.2f} {r['chain_ms_median']:10.3f} {r['chain_ms_p90']:8.3f} "
            f"{r['chain_ms_max']:8.3f} {r['chain_ms_median'] / res['chain_alone_ms']:8.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "priority-probe")


if __name__ == "__main__":
    sys.exit(main())
