"""Can the Reasoner decode while a 720p video step runs on the same GPU? A probe for SM sharing.

Under one model lock a chat would get one token per 5.3 s denoising step. This probe builds the full-size
Nano transformer (random bf16 weights, compiled, the product's attention or --attention-backend's) and its
CUDA-graphed decode step, and measures, for each SM margin M in --margins:
- the video step alone (one CFG step, 1280x720x189 + audio, 300-token prompts) with FA3's `sm_margin` = M
  and cuBLAS's SM carve-out = M (`torch._C._set_sm_carveout_experimental`): what the margin costs video;
- the same step while a second thread decodes --chats chats in a loop on a high-priority stream (the graph
  replayed there, waiting on an event without the GIL): the video step's time, and the chat's steps and
  tokens/s during it.
The graphed decode step alone is timed first (its speed with the whole GPU), and the video step alone with
the transformer's launch window off and at --launch-window (what a ready Reasoner sets; its cost, if any).
Prints a table last; JSON to --out.

    PYTHONPATH=. python bench/chat_during_video.py --out $OUT/chat_during_video.json   # H200: ~4 min
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file (or folder for chat-during-video-<stamp>.json)")
    ap.add_argument("--margins", default="0,16,32", help="SM margins to try (comma list)")
    ap.add_argument("--chats", type=int, default=8, help="chats decoded together in the chat thread")
    ap.add_argument("--context", type=int, default=300, help="tokens in each chat's cache at the start")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-backend", default=None, choices=("FLASH_ATTN",),
                    help="the video's attention kernel (default: auto, as serve: the gen layers through FA4's "
                    "cluster kernel where it runs)")  # fmt: skip
    ap.add_argument("--launch-window", type=int, default=2,
                    help="the transformer's launch_window during the margin runs (what a ready Reasoner sets)")  # fmt: skip
    return ap.parse_args(argv)


def run(args: argparse.Namespace, log=print, save=lambda res: None) -> dict:
    from worldserve.bench.denoise import OurStep, make_inputs
    from worldserve.bench.models import build_our_transformer
    from worldserve.bench.report import environment
    from worldserve.bench.timing import time_once, time_region
    from worldserve.bench.und_decode import _prompts, make_decoder
    from worldserve.bench.workload import Workload
    from worldserve.models.cosmos3.batch import UndBatch
    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.runner.chat_share import set_sm_margin

    device = torch.device("cuda")
    cfg = Cosmos3Config.nano()
    res: dict = {"environment": environment(device), "args": vars(args), "runs": [],
                 "cublas_carveout": hasattr(torch._C, "_set_sm_carveout_experimental")}  # fmt: skip
    t0 = time.perf_counter()
    model = build_our_transformer(cfg, device, torch.bfloat16, None, args.seed)
    res["attention"] = model.set_attention_backend(args.attention_backend)
    model.compile_gen_layers()
    w = Workload(width=1280, height=720, num_frames=189, sound=True, cond_text=300, uncond_text=300)
    video = OurStep(model, w, make_inputs(w, cfg.vocab_size, device, args.seed))
    video.prefill()
    decoder = make_decoder(model, max_batch=args.chats, tokens=args.chats * (args.context + 4096))
    decoder.capture_all()
    seqs = [decoder.pool.sequence() for _ in range(args.chats)]
    for s in seqs:
        s.reserve(args.context)
    model.und_step(UndBatch.text(_prompts(model, device, args.chats, args.context)), seqs, kv_only=True)
    tokens = [7 + i for i in range(args.chats)]
    hp = torch.cuda.Stream(device, priority=-1)  # the highest priority PyTorch offers

    def chat_step() -> None:
        for s in seqs:
            s.reserve(1)
        with torch.cuda.stream(hp):
            decoder.step(tokens, seqs, [s.length for s in seqs])
            ev = torch.cuda.Event()
            ev.record(hp)
        while not ev.query():  # wait without holding the GIL for long
            time.sleep(0.0002)

    def video_step() -> float:
        """Seconds of one video step on the default stream, waited for by polling (no GIL held)."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        video(999)
        end.record()
        while not end.query():
            time.sleep(0.001)
        return start.elapsed_time(end) / 1e3

    log(f"built in {time.perf_counter() - t0:.0f} s; warming up the video step (compiles)")
    time_once(lambda: video(999), device)
    res["chat_alone_ms"] = time_region(chat_step, device, warmup=2, repeats=20).median * 1e3
    log(f"chat alone: {res['chat_alone_ms']:.2f} ms a step ({args.chats} chats)")
    res["launch_window_s"] = {}
    for window in (0, args.launch_window, 0, args.launch_window):  # its cost to a video step alone
        model.launch_window = window
        torch.cuda.synchronize(device)
        res["launch_window_s"].setdefault(str(window), []).append(video_step())
    log(f"video step by launch window: {res['launch_window_s']}")
    model.launch_window = args.launch_window
    for m in (int(x) for x in args.margins.split(",")):
        set_sm_margin(m)  # what a live chat makes the Reasoner set (runner/chat_share.py)
        torch.cuda.synchronize(device)
        alone = video_step()
        done = threading.Event()
        count = [0]

        def chat_loop(done=done, count=count) -> None:
            while not done.is_set():
                chat_step()
                count[0] += 1

        thread = threading.Thread(target=chat_loop)
        t = time.perf_counter()
        thread.start()
        time.sleep(0.05)  # the chat loop runs before the video step starts
        shared = video_step()
        wall = time.perf_counter() - t
        done.set()
        thread.join()
        run_ = {"margin": m, "video_alone_s": alone, "video_with_chat_s": shared, "chat_steps": count[0],
                "chat_tok_s_per_chat": count[0] / wall, "chat_ms_per_step": wall / max(count[0], 1) * 1e3}  # fmt: skip
        res["runs"].append(run_)
        log(str(run_))
        save(res)
    set_sm_margin(0)
    res["wall_s"] = time.perf_counter() - t0
    return res


def table(res: dict) -> str:
    windows = ", ".join(f"{w}: {min(t):.3f} s" for w, t in res.get("launch_window_s", {}).items())
    lines = [
        f"chat during video ({res['attention']}), {res['args']['chats']} chats, decode alone "
        f"{res['chat_alone_ms']:.2f} ms a step",
        f"video step alone by launch window (layers queued ahead; 0 = all): {windows}",
        f"{'margin':>6s} {'video s':>8s} {'w/ chat s':>9s} {'chat steps':>10s} {'ms/step':>8s} {'tok/s/chat':>10s}",
    ]
    for r in res["runs"]:
        lines.append(
            f"{r['margin']:6d} {r['video_alone_s']:8.3f} {r['video_with_chat_s']:9.3f} {r['chat_steps']:10d} "
            f"{r['chat_ms_per_step']:8.1f} {r['chat_tok_s_per_chat']:10.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from worldserve.bench.report import run_script

    return run_script(parse_args(argv), run, table, "chat-during-video")


if __name__ == "__main__":
    sys.exit(main())
