"""`worldserve serve` end to end on one GPU: chat completions over HTTP at several concurrencies, plus a video.

Starts `python -m worldserve.cli serve MODEL` as a subprocess (log: <out dir>/serve.log), waits for /health,
then, for each --concurrency c, sends c chat completions at once (non-streaming, --max-tokens each, NVIDIA's
suggested sampling: temperature 0.7, top_p 0.8, top_k 20, presence_penalty 1.5) and reports the wall time,
the completion tokens per second in all and per chat, next to the decode step's own rate
(bench/reasoner_decode.py). A max_tokens=1 chat gives the time to first token (prefill + HTTP). A small
video (/v1/videos/sync, 256x256, 9 frames, 2 steps) checks that video generation shares the process; with
--beside-video, chats are also timed while a video job denoises (runner/chat_share.py); --stream sends every
chat as server-sent events (each chat's time per token after its first content chunk is reported too);
--text-tokens restricts the chats to the tokenizer's letters (allowed_token_ids) so that every token is a
content chunk; --logprobs N asks for logprobs; --repeat N runs each concurrency N times (median);
--structured times the chats again under a JSON schema (structured outputs); --http-stack plain runs the
server without uvloop (asyncio's loop; httptools blocked too, for runs of older trees), to weigh it; --client-processes P splits each round's
chats over P processes (the benchmark's GIL otherwise caps the events it can read). Last, the K/V metrics from
/metrics. Everything the server does is the product's code path: paged K/V pool,
CUDA-graphed decode, batched sampling, incremental detokenization, SSE-free JSON responses.

--random-nano DIR writes (once) a full-size random Nano checkpoint with the tiny byte tokenizer
(bench/parallel_step.py): most sampled ids are outside that tokenizer, so texts are mostly empty while the
token counts are real.

    PYTHONPATH=. python bench/serve_chat.py --random-nano /tmp/nano-random --out $OUT/serve_chat.json
    PYTHONPATH=. python bench/serve_chat.py --tiny --out /tmp/serve_chat.json      # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

SAMPLING = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "presence_penalty": 1.5}
HTTP = httpx.Client(limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
"""One client (thread-safe, pooled keep-alive connections) for all chats: a fresh httpx client per request
costs the benchmark's own process ~10-20 ms of setup under its GIL, which spread the c chats' arrivals
over half a second and showed up as server time."""


def add_server_source(ap: argparse.ArgumentParser) -> None:
    """--out, which checkpoint the started server loads and its extra flags (also bench/serve_video.py's)."""
    ap.add_argument("--out", type=Path, required=True, help="JSON file; serve.log goes next to it")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint folder")
    src.add_argument("--random-nano", type=Path, help="write / reuse a random full-size Nano checkpoint here")
    src.add_argument("--tiny", action="store_true", help="the embedded tiny checkpoint (no MODEL)")
    ap.add_argument(
        "--serve-arg", action="append", default=[],
        help="extra flag for serve (repeatable; e.g. --serve-arg=--cfg-parallel-size --serve-arg=2)",
    )  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_source(ap)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--text-tokens", action="store_true",
        help="chats sample only the tokenizer's letters (allowed_token_ids), so every token is a content chunk "
        "(a random checkpoint with the tiny byte tokenizer otherwise samples mostly ids that decode to nothing)",
    )  # fmt: skip
    ap.add_argument(
        "--repeat", type=int, default=1, help="rounds of each --concurrency; the median is reported"
    )
    ap.add_argument("--logprobs", type=int, default=None, metavar="N",
                    help="every chat asks for logprobs with N top alternatives (0-20)")  # fmt: skip
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument(
        "--stream", action="store_true", help="chats as server-sent events (default: JSON answers)"
    )
    ap.add_argument(
        "--api-checks", action="store_true",
        help="also the Reasoner's other routes on this server: /v1/completions (n=2 token-id prompt, logprobs, "
        "streamed; 8 at once; ignore_eos + min_tokens), /tokenize (prompt and chat with an image), /detokenize, a chat whose image is an "
        "http URL (served by this script), /ping, /load",
    )  # fmt: skip
    ap.add_argument(
        "--structured",
        action="store_true",
        help="also the chats of each --concurrency under a JSON schema (response_format): tokens/s vs free",
    )
    ap.add_argument(
        "--beside-video", default=None, metavar="WxHxFRAMESxSTEPS",
        help="also send --concurrency's last count of chats while a video job of this shape denoises "
        "(e.g. 1280x720x189x4): their tokens/s beside the video step, and the job's own wall time",
    )  # fmt: skip
    ap.add_argument(
        "--upsample", action="store_true",
        help="also a T2V and an I2V job with extra_params.upsample_prompt (bench/upsampled_videos.py)",
    )  # fmt: skip
    ap.add_argument("--responses", action="store_true", help="also /v1/responses (bench/responses_checks.py)")
    ap.add_argument(
        "--client-processes", type=int, default=1, metavar="P",
        help="each --concurrency round's chats split over P client processes (threads in each), so the "
        "benchmark's own GIL does not cap what the server delivers",
    )  # fmt: skip
    ap.add_argument(
        "--http-stack", choices=("installed", "plain"), default="installed",
        help="plain: the server runs without uvloop and httptools (asyncio's loop; h11, which serve uses "
        "anyway since the twenty-fifth session), to weigh what they bring against the installed ones",
    )  # fmt: skip
    return ap.parse_args(argv)


PLAIN_STACK = (
    "import sys; sys.modules['httptools'] = sys.modules['uvloop'] = None; "
    "from worldserve.cli import main; sys.exit(main())"
)
"""`python -c PLAIN_STACK serve ...`: `worldserve serve` with httptools and uvloop unimportable, so uvicorn
falls back to h11 and asyncio (its choice when they are not installed)."""


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"serve not healthy after {timeout:.0f} s")


STREAM = False
"""--stream: every chat as server-sent events (usage from the last chunk), as most chat clients call it."""
ONLY_TOKENS: list[int] | None = None
"""--text-tokens: the ids every chat may sample (allowed_token_ids), each one a visible character."""
TOP_LOGPROBS: int | None = None
"""--logprobs N: every chat asks for its tokens' logprobs with N alternatives."""


def chat(url: str, model: str, max_tokens: int, i: int, extra: dict | None = None) -> dict:
    """One chat: its wall `s` and completion `tokens`; streamed, also `ttft_s` (the first content chunk) and
    `chunks` (content chunks received)."""
    body = {"model": model, "max_tokens": max_tokens, "seed": i, **SAMPLING, **(extra or {}),
            "messages": [{"role": "user", "content": f"Describe scene {i} of a fox in the snow."}]}  # fmt: skip
    if ONLY_TOKENS is not None:
        body["allowed_token_ids"] = ONLY_TOKENS
    if TOP_LOGPROBS is not None:
        body |= {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
    t0 = time.perf_counter()
    if not STREAM:
        r = HTTP.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()
        return {"s": time.perf_counter() - t0, "tokens": r.json()["usage"]["completion_tokens"]}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    usage, first, chunks = None, None, 0
    with HTTP.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith('data: {"id"') and '"content":"' in line and '"content":""' not in line:
                chunks += 1
                first = first or time.perf_counter() - t0
            if line.startswith("data: {") and '"usage":{' in line:
                usage = json.loads(line[6:])["usage"]
    return {
        "s": time.perf_counter() - t0,
        "tokens": usage["completion_tokens"],
        "ttft_s": first,
        "chunks": chunks,
    }


def chats_at_once(url: str, model: str, max_tokens: int, ids: list[int]) -> list[dict]:
    """`chat` for each id in `ids`, all at once (a thread each)."""
    with ThreadPoolExecutor(len(ids)) as pool:
        return list(pool.map(lambda i: chat(url, model, max_tokens, i), ids))


def _chats_in_child(job: tuple) -> list[dict]:
    """chats_at_once in a --client-processes child, which gets the parent's settings with its share."""
    global STREAM, ONLY_TOKENS, TOP_LOGPROBS
    url, model, max_tokens, ids, STREAM, ONLY_TOKENS, TOP_LOGPROBS = job
    return chats_at_once(url, model, max_tokens, ids)


def text_token_ids(url: str, model: str) -> list[int]:
    """The ids of the letters a-z in the served tokenizer (/tokenize), for --text-tokens."""
    r = HTTP.post(url + "/tokenize", json={"model": model, "prompt": " ".join("abcdefghijklmnopqrstuvwxyz"),
                                           "add_special_tokens": False}, timeout=60)  # fmt: skip
    r.raise_for_status()
    return sorted(set(r.json()["tokens"]))


def decode_ms(outs: list[dict]) -> float | None:
    """Median over streamed chats of the time per token after each one's first content chunk."""
    per = sorted(
        (o["s"] - o["ttft_s"]) / (o["tokens"] - 1) * 1e3 for o in outs if o.get("ttft_s") and o["tokens"] > 1
    )
    return per[len(per) // 2] if per else None


def chats_beside_video(url: str, served: str, args: argparse.Namespace) -> dict:
    """A video job of --beside-video's shape; once its first step is done (compiled), the last --concurrency
    count of chats at once. Their tokens/s, how many steps the job made meanwhile, the job's total time."""
    w, h, frames, steps = (int(x) for x in args.beside_video.lower().split("x"))
    body = {
        "prompt": "A fox in the snow.",
        "size": f"{w}x{h}",
        "num_frames": frames,
        "num_inference_steps": steps,
    }
    t0 = time.perf_counter()
    job = httpx.post(url + "/v1/videos", json=body, timeout=60).json()
    progress = lambda: httpx.get(f"{url}/v1/videos/{job['id']}", timeout=60).json()  # noqa: E731
    while (p := progress())["status"] in ("queued", "in_progress") and p["progress"] == 0:
        time.sleep(0.2)
    c = int(args.concurrency.split(",")[-1])
    before, t1 = p, time.perf_counter()
    outs = chats_at_once(url, served, args.max_tokens, [1000 + i for i in range(c)])
    wall, during = time.perf_counter() - t1, progress()
    while (p := progress())["status"] in ("queued", "in_progress"):
        time.sleep(0.5)
    tokens = sum(o["tokens"] for o in outs)
    out = {"video": body, "chats": c, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
           "per_chat_tok_s": min(o["tokens"] / o["s"] for o in outs), "progress_before": before["progress"],
           "progress_after": during["progress"], "video_status": p["status"],
           "video_total_s": time.perf_counter() - t0}  # fmt: skip
    print(f"{c} chats beside a {args.beside_video} video: {tokens} tokens in {wall:.2f} s", flush=True)
    return out


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def run(args: argparse.Namespace) -> dict:
    global STREAM, TOP_LOGPROBS
    STREAM, TOP_LOGPROBS = args.stream, args.logprobs
    args.out.parent.mkdir(parents=True, exist_ok=True)
    model = args.model
    if args.random_nano is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        from parallel_step import write_random_checkpoint

        model = str(write_random_checkpoint(args.random_nano))
    url = f"http://127.0.0.1:{args.port}"
    entry = ["-c", PLAIN_STACK] if args.http_stack == "plain" else ["-m", "worldserve.cli"]
    cmd = [sys.executable, *entry, "serve", *([model] if model else []), "--port", str(args.port),
           "--warmup-shapes", "none", *args.serve_arg]  # fmt: skip
    log = open(args.out.parent / "serve.log", "w")  # noqa: SIM115 (the server writes to it until killed)
    # the image chat by URL downloads from this script's own file server on loopback, which serve refuses
    # unless told (api/media_urls.py)
    env = {**os.environ, "WORLDSERVE_MEDIA_ALLOW_PRIVATE_ADDRESSES": "1"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    import torch

    from worldserve.bench.report import environment

    res: dict = {
        "environment": environment(torch.device("cuda" if torch.cuda.is_available() else "cpu")),
        "command": " ".join(cmd),
        "max_tokens": args.max_tokens,
        "sampling": SAMPLING,
        "stream": args.stream,
        "http_stack": args.http_stack,
        "client_processes": args.client_processes,
    }
    try:
        res["startup_s"] = wait_healthy(url, proc, args.startup_timeout)
        served = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        if args.text_tokens:
            global ONLY_TOKENS
            ONLY_TOKENS = res["allowed_token_ids"] = text_token_ids(url, served)
        chat(url, served, 8, -1)  # a first request outside the timings
        res["ttft_s"] = min(chat(url, served, 1, -2 - k)["s"] for k in range(3))
        res["chats"] = {}
        clients = None
        if args.client_processes > 1:
            import multiprocessing
            from concurrent.futures import ProcessPoolExecutor

            P = args.client_processes
            clients = ProcessPoolExecutor(P, mp_context=multiprocessing.get_context("spawn"))
            job = lambda ids, n=args.max_tokens: (url, served, n, ids, STREAM, ONLY_TOKENS, TOP_LOGPROBS)  # noqa: E731
            list(
                clients.map(_chats_in_child, [job([-10 - k], 8) for k in range(P)])
            )  # started, outside the timings
        for c in (int(x) for x in args.concurrency.split(",")):
            rounds = []
            for _ in range(args.repeat):
                t0 = time.perf_counter()
                if clients is None:
                    outs = chats_at_once(url, served, args.max_tokens, list(range(c)))
                else:
                    shares = [job(list(range(c))[k::P]) for k in range(min(P, c))]
                    outs = [o for part in clients.map(_chats_in_child, shares) for o in part]
                wall = time.perf_counter() - t0
                tokens = sum(o["tokens"] for o in outs)
                rounds.append({"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                               "per_chat_tok_s": min(o["tokens"] / o["s"] for o in outs),
                               "chunks": sum(o.get("chunks", 0) for o in outs), "decode_ms": decode_ms(outs)})  # fmt: skip
                ms = (
                    f", {rounds[-1]['decode_ms']:.2f} ms a token after the first"
                    if rounds[-1]["decode_ms"]
                    else ""
                )
                print(f"{c} chats: {tokens} tokens in {wall:.2f} s{ms}", flush=True)
            median = sorted(rounds, key=lambda r: r["wall_s"])[len(rounds) // 2]
            res["chats"][str(c)] = {**median, "walls_s": [r["wall_s"] for r in rounds]}
        if clients is not None:
            clients.shutdown()
        if args.api_checks:
            from api_checks import api_checks

            res["api_checks"] = api_checks(url, served, args.max_tokens, HTTP, SAMPLING)
        if args.structured:
            from structured_chats import structured_chats

            res["structured"] = structured_chats(url, served, args, chat, HTTP)
        if args.beside_video:
            res["beside_video"] = chats_beside_video(url, served, args)
        if args.upsample:
            from upsampled_videos import upsampled_videos

            res["upsampled"] = upsampled_videos(url)
        if args.responses:
            from responses_checks import responses_checks

            res["responses"] = responses_checks(url, served, args.max_tokens)
        t0 = time.perf_counter()
        body = {"prompt": "A fox in the snow.", "size": "256x256", "num_frames": 9, "num_inference_steps": 2}
        r = httpx.post(url + "/v1/videos/sync", json=body, timeout=600)
        res["video"] = {"status": r.status_code, "bytes": len(r.content), "content_type": r.headers.get("content-type"),
                        "s": time.perf_counter() - t0}  # fmt: skip
        text = httpx.get(url + "/metrics").text
        res["metrics"] = {
            "kv_cache_usage_perc": metric(text, "worldserve:kv_cache_usage_perc"),
            "num_preemptions": metric(text, "worldserve:num_preemptions_total"),  # (a counter)
        }
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return res


def table(res: dict) -> str:
    lines = [f"serve up in {res['startup_s']:.1f} s; time to first token {res['ttft_s'] * 1e3:.0f} ms; "
             f"{res['max_tokens']} tokens a chat; HTTP stack {res['http_stack']}; {res['client_processes']} client process(es)", f"{'chats':>5s} {'wall s':>8s} {'tok/s':>9s} {'per chat':>9s} {'chunks':>7s} {'ms/token':>9s}"]  # fmt: skip
    for c, r in res["chats"].items():
        ms = f"{r['decode_ms']:9.2f}" if r.get("decode_ms") else f"{'-':>9s}"
        lines.append(
            f"{c:>5s} {r['wall_s']:8.2f} {r['tok_s']:9.1f} {r['per_chat_tok_s']:9.1f} {r['chunks']:7d} {ms}"
        )
    lines.append(
        "ms/token: a streamed chat's time per token after its first content chunk (median over chats)"
    )
    if b := res.get("beside_video"):
        lines.append(f"{b['chats']} chats beside a {b['video']['size']} x {b['video']['num_frames']} video: "
                     f"{b['wall_s']:.2f} s, {b['tok_s']:.1f} tok/s, {b['per_chat_tok_s']:.1f} per chat; video "
                     f"progress {b['progress_before']} -> {b['progress_after']} %, {b['video_status']} after "
                     f"{b['video_total_s']:.0f} s")  # fmt: skip
    for key, r in res.get("structured", {}).items():
        if key == "tool_calls":
            lines.append(f"tool calls: {r}")
        elif not key.endswith("_ratio"):
            lines.append(f"{key:>14s} {r['wall_s']:8.2f} {r['tok_s']:9.1f} {r['per_chat_tok_s']:9.1f}")
    v = res["video"]
    lines.append(f"video: HTTP {v['status']}, {v['bytes']} bytes {v['content_type']}, {v['s']:.1f} s; "
                 f"metrics {res['metrics']}")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    res = run(args)
    args.out.write_text(json.dumps(res, indent=1))
    print(table(res))
    beside_ok = res.get("beside_video", {}).get("video_status", "completed") == "completed"
    return 0 if res["video"]["status"] == 200 and beside_ok else 1


if __name__ == "__main__":
    sys.exit(main())
