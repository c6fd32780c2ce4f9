"""The recipe's video requests over HTTP against `worldserve serve` at full size: T2V and I2V on /v1/videos/sync.

Starts `python -m worldserve.cli serve MODEL --host 127.0.0.1 --port P --init-timeout 1800 --omni` (startup
warm-up at its default, `--warmup-shapes auto`), waits for /health, then sends the product recipe's
multipart form (serving-api.md §1: JSON prompt, the default negative prompt file, size, num_frames, fps 24,
guidance 6.0, max_sequence_length 4096, flow shift 10, seed) as a text-to-video request and again with an
`input_reference` JPEG (image-to-video), `--steps` steps each; `--lora-rank N` adds the T2V request naming
a random rank-N adapter (the server runs with --enable-lora; with `--static-lora` the server runs it as
--lora-path instead, merged into the weights at load, and every request runs it). Every MP4 is decoded back (codecs, frames,
fps, audio rate and channels); the JSON records each request's wall time and the server's own stage times
(/metrics: worldserve:stage_duration_seconds sums). `--realtime` also runs the T2V request as a
/v1/realtime/video session (fragmented MP4 parts while the VAE decodes): the times to video.start, to the
first part holding frames and to session.done, against the sync request's whole MP4 (and the server's stage
times of the session).

    PYTHONPATH=. python bench/serve_video.py --random-nano /tmp/nano-random --steps 8 --out $OUT/serve_video.json
    PYTHONPATH=. python bench/serve_video.py --random-nano /tmp/nano-random --requests t2v --out ...  # 35 steps, T2V
    PYTHONPATH=. python bench/serve_video.py --random-nano /tmp/nano-random --steps 4 --serve-arg=--cfg-parallel-size \
        --serve-arg=2 --out $OUT/serve_video.json  # 2 GPUs
    PYTHONPATH=. python bench/serve_video.py --random-nano /tmp/nano-random --steps 2 --lora-rank 64 --out ...
    PYTHONPATH=. python bench/serve_video.py --random-nano /tmp/nano-random --steps 2 --lora-rank 64 --static-lora ...
    PYTHONPATH=. python bench/serve_video.py --tiny --size 64x48 --frames 9 --steps 2 --out /tmp/sv.json  # CPU
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_chat import add_server_source, wait_healthy  # noqa: E402
from upsampled_videos import _jpeg  # noqa: E402

PROMPT = {"caption": "A red fox trots through fresh snow at dawn, its breath visible.", "camera": "static"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_server_source(ap)
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--frames", type=int, default=189)
    ap.add_argument("--steps", type=int, default=35)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--realtime", action="store_true", help="also the T2V request over /v1/realtime/video")
    ap.add_argument("--requests", default="t2v,i2v", help="which sync requests to send, in order (t2v, i2v)")
    ap.add_argument("--static-lora", action="store_true",
                    help="serve the --lora-rank adapter as --lora-path instead (no --enable-lora: merged into the "
                         "weights at load, every request runs it; no extra request)")  # fmt: skip
    ap.add_argument("--lora-rank", type=int, default=0,
                    help="also a T2V request naming a random LoRA adapter of this rank on every module (the server "
                         "runs with --enable-lora; weights/lora_adapter.py write_random_adapter)")  # fmt: skip
    return ap.parse_args(argv)


def recipe_form(args: argparse.Namespace) -> dict[str, str]:
    from importlib.resources import files

    negative = (files("worldserve.assets") / "negative_prompt.json").read_text()
    return {"prompt": json.dumps(PROMPT), "negative_prompt": negative, "size": args.size,
            "num_frames": str(args.frames), "fps": "24", "num_inference_steps": str(args.steps),
            "guidance_scale": "6.0", "max_sequence_length": "4096", "flow_shift": "10.0", "seed": "123"}  # fmt: skip


def probe_mp4(data: bytes) -> dict:
    """What a player sees: codecs, frame count and rate, audio rate, channels and samples past the edit
    list's priming trim (decoded, not read off the container's headers)."""
    import av

    with av.open(io.BytesIO(data)) as c:
        video, audio = c.streams.video[0], c.streams.audio[0]
        frames = sum(1 for _ in c.decode(video=0))
        c.seek(0)
        samples = sum(f.samples for f in c.decode(audio=0))
        return {"video_codec": video.codec_context.name, "size": f"{video.width}x{video.height}",
                "frames": frames, "fps": float(video.average_rate), "audio_codec": audio.codec_context.name,
                "sample_rate": audio.sample_rate, "channels": audio.channels, "audio_samples": samples,
                "bytes": len(data)}  # fmt: skip


def realtime_session(url: str, form: dict[str, str]) -> dict:
    """The T2V request as a /v1/realtime/video session: when each message came (seconds from the start),
    the parts' frames and bytes, and the joined MP4 decoded."""
    from websockets.sync.client import connect

    start = {"type": "session.start", "format": "m4s", **form}
    parts, events, t0 = [], [], time.perf_counter()
    with connect(
        url.replace("http://", "ws://") + "/v1/realtime/video", max_size=None, open_timeout=60
    ) as ws:
        ws.send(json.dumps(start))
        for raw in ws:
            at = time.perf_counter() - t0
            if isinstance(raw, bytes):
                parts.append(raw)
                continue
            msg = json.loads(raw)
            events.append({"type": msg["type"], "at_s": round(at, 3), **{k: msg[k] for k in ("num_frames",
                           "byte_length", "chunks", "stopped", "message") if k in msg}})  # fmt: skip
            if msg["type"] in ("session.done", "error"):
                break
    media = [e for e in events if e["type"] == "video.chunk_metadata"]
    first_frames = next((e["at_s"] for e in media if e["num_frames"]), None)
    out = {"events": events, "parts": len(parts), "bytes": sum(map(len, parts)), "first_frames_s": first_frames,
           "start_s": events[0]["at_s"], "done_s": events[-1]["at_s"], "ok": events[-1]["type"] == "session.done"}  # fmt: skip
    if out["ok"]:
        out["mp4"] = probe_mp4(b"".join(parts))
    return out


def stage_seconds(url: str) -> dict[str, float]:
    """The server's per-stage time sums so far (worldserve:stage_duration_seconds_sum by stage)."""
    out: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("worldserve:stage_duration_seconds_sum{"):
            stage = line.split('stage="', 1)[1].split('"', 1)[0]
            out[stage] = out.get(stage, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def write_adapter(model: list[str], rank: int, folder: str) -> str:
    """A random PEFT adapter of `rank` on every module LoRA applies to, at the served checkpoint's shapes
    (bf16), in `folder`; its path."""
    import torch

    from worldserve.models.cosmos3.config import Cosmos3Config
    from worldserve.weights.checkpoint import default_tiny_checkpoint
    from worldserve.weights.lora_adapter import write_random_adapter

    root = Path(model[0]) if model else default_tiny_checkpoint()
    config = Cosmos3Config.from_json(root / "transformer" / "config.json")
    return write_random_adapter(Path(folder) / f"lora-r{rank}", config, rank=rank, alpha=rank, std=0.02,
                                dtype=torch.bfloat16)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.random_nano is not None:
        from parallel_step import write_random_checkpoint

        model = [str(write_random_checkpoint(args.random_nano))]
    else:
        model = [] if args.tiny else [args.model]
    url = f"http://127.0.0.1:{args.port}"
    # a fresh store: no job of an earlier, interrupted run re-queued beside the timed requests, and no 84 MB
    # MP4s left in the out folder
    store = tempfile.mkdtemp(prefix="serve_video-")
    adapter = write_adapter(model, args.lora_rank, store) if args.lora_rank else None
    lora = [] if adapter is None else ["--lora-path", adapter] if args.static_lora else ["--enable-lora"]
    cmd = [sys.executable, "-m", "worldserve.cli", "serve", *model, "--host", "127.0.0.1",
           "--port", str(args.port), "--init-timeout", "1800", "--omni", "--storage-dir", store,
           *lora, *args.serve_arg]  # fmt: skip
    log = open(args.out.with_name("serve.log"), "w")  # noqa: SIM115 (open for the server's lifetime)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    import torch

    from worldserve.bench.report import environment

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result: dict = {"environment": environment(device), "command": " ".join(cmd[1:]), "requests": {}}
    try:
        result["startup_s"] = wait_healthy(url, proc, args.startup_timeout)
        form = recipe_form(args)
        references = {
            "t2v": None,
            "i2v": {"input_reference": ("ref.jpg", _jpeg(), "image/jpeg")},
            "t2v-lora": None,
        }
        names = args.requests.split(",") + (["t2v-lora"] if adapter and not args.static_lora else [])
        for name in names:
            files = references[name]
            data = (
                {**form, "lora": json.dumps({"name": "random", "path": adapter})}
                if name == "t2v-lora"
                else form
            )
            before = stage_seconds(url)
            t0 = time.perf_counter()
            r = httpx.post(url + "/v1/videos/sync", data=data, files=files, headers={"Accept": "video/mp4"},
                           timeout=3600)  # fmt: skip
            wall = time.perf_counter() - t0
            entry = {"status": r.status_code, "wall_s": wall, "content_type": r.headers.get("content-type")}
            if r.status_code == 200:
                entry["mp4"] = probe_mp4(r.content)
                after = stage_seconds(url)
                entry["server_stages_s"] = {k: after[k] - before.get(k, 0.0) for k in after}
            else:
                entry["error"] = r.text[:500]
            result["requests"][name] = entry
            print(name, json.dumps(entry), flush=True)
        if args.realtime:
            before = stage_seconds(url)
            result["realtime"] = realtime_session(url, form)
            after = stage_seconds(url)
            result["realtime"]["server_stages_s"] = {k: after[k] - before.get(k, 0.0) for k in after}
            print("realtime", json.dumps({k: v for k, v in result["realtime"].items() if k != "events"}),
                  flush=True)  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:  # it would hold the port and the GPU
            proc.kill()
            proc.wait()
        log.close()
    result["exit_status"] = proc.returncode  # (0 after SIGTERM's graceful shutdown and the cleanup)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"serve up in {result['startup_s']:.1f} s (model load + warm-up)")
    print("request  status  wall s  frames  size       audio")
    for name, e in result["requests"].items():
        m = e.get("mp4", {})
        print(f"{name:8} {e['status']:6}  {e['wall_s']:6.1f}  {m.get('frames', '-'):>6}  {m.get('size', '-'):9}  "
              f"{m.get('audio_codec', '-')} {m.get('sample_rate', '')} x{m.get('channels', '')}")  # fmt: skip
    if rt := result.get("realtime"):
        m = rt.get("mp4", {})
        print(f"realtime: video.start {rt['start_s']:.2f} s, first frames {rt['first_frames_s']} s, done "
              f"{rt['done_s']:.1f} s (sync t2v {result['requests']['t2v']['wall_s']:.1f} s); {rt['parts']} parts, "
              f"{m.get('frames', '-')} frames, {m.get('audio_codec', '-')} {m.get('sample_rate', '')}, "
              f"{m.get('audio_samples')} audio samples (sync "
              f"{result['requests']['t2v'].get('mp4', {}).get('audio_samples')})")  # fmt: skip


if __name__ == "__main__":
    main()
