"""bench/serve_chat.py --api-checks: the Reasoner's other routes against a running `worldserve serve`
(serve_chat.py starts it): /v1/completions (n=2 token-id prompt, logprobs, streamed; 8 at once; ignore_eos +
min_tokens), /tokenize and /detokenize, a chat whose image is an http URL served by this script, image and
video chats (media_chats), /ping and /load. `HTTP` and `SAMPLING` are serve_chat.py's pooled client and
sampling settings.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx


def api_checks(url: str, served: str, max_tokens: int, HTTP: httpx.Client, SAMPLING: dict) -> dict:  # noqa: N803
    """The Reasoner's routes besides chat on this server (full size when --random-nano): status codes, token
    counts, and the completions rate at 8 at once (the chat worker's path with raw token-id prompts)."""
    import base64
    import functools
    import http.server
    import io
    import tempfile
    import threading

    import numpy as np
    from PIL import Image

    out: dict = {}
    ids = list(range(100, 400))  # a 300-token raw prompt
    body = {
        "model": served,
        "prompt": ids,
        "max_tokens": max_tokens,
        "n": 2,
        "logprobs": 2,
        "seed": 1,
        **SAMPLING,
    }
    r = HTTP.post(url + "/v1/completions", json=body, timeout=600)
    comp = r.json()
    out["completions"] = {"status": r.status_code, "choices": len(comp.get("choices", [])),
                          "usage": comp.get("usage"), "logprob_positions": len((comp.get("choices") or [{}])[0]
                                                                               .get("logprobs", {}).get("tokens", []))}  # fmt: skip
    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        rs = list(pool.map(lambda i: HTTP.post(url + "/v1/completions", json={**body, "n": 1, "logprobs": None,
                                                                             "seed": i}, timeout=600), range(8)))  # fmt: skip
    wall = time.perf_counter() - t0
    tokens = sum(x.json()["usage"]["completion_tokens"] for x in rs if x.status_code == 200)
    out["completions_8"] = {
        "statuses": sorted({x.status_code for x in rs}),
        "tokens": tokens,
        "tok_s": tokens / wall,
    }
    with HTTP.stream(
        "POST", url + "/v1/completions", json={**body, "n": 1, "stream": True}, timeout=600
    ) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    out["completions_stream"] = {
        "status": s.status_code,
        "events": len(lines),
        "done": lines[-1] == "data: [DONE]",
    }
    ends = {**body, "n": 1, "logprobs": None, "max_tokens": 32, "ignore_eos": True, "min_tokens": 16}
    r = HTTP.post(url + "/v1/completions", json=ends, timeout=600).json()
    out["ignore_eos_min_tokens"] = {"finish": r["choices"][0]["finish_reason"],
                                    "tokens": r["usage"]["completion_tokens"]}  # fmt: skip
    tok = HTTP.post(url + "/tokenize", json={"model": served, "prompt": "A fox in the snow."}).json()
    detok = HTTP.post(url + "/detokenize", json={"model": served, "tokens": tok.get("tokens", [])}).json()
    out["tokenize"] = {"count": tok.get("count"), "max_model_len": tok.get("max_model_len"),
                       "round_trip": detok.get("prompt") == "A fox in the snow."}  # fmt: skip
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (360, 640, 3), np.uint8)).save(buf, "PNG")
    folder = Path(tempfile.mkdtemp())
    (folder / "frame.png").write_bytes(buf.getvalue())
    files = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    )
    threading.Thread(target=files.serve_forever, daemon=True).start()
    try:
        counts = {}
        for name, ref in (("http", f"http://127.0.0.1:{files.server_address[1]}/frame.png"),
                          ("data", "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())):  # fmt: skip
            messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ref}},
                                                     {"type": "text", "text": "What is in the image?"}]}]  # fmt: skip
            r = HTTP.post(url + "/v1/chat/completions", json={"model": served, "messages": messages, "max_tokens": 8,
                                                             "temperature": 0}, timeout=600)  # fmt: skip
            body = r.json()
            counts[name] = (r.status_code, body.get("usage", {}).get("prompt_tokens"), body.get("error"))
            if name == "http":
                t = HTTP.post(url + "/tokenize", json={"model": served, "messages": messages}).json()
                out["tokenize_chat_count"] = t.get("count")
        out["image_chats"] = counts
    finally:
        files.shutdown()
    out["media_chats"] = media_chats(url, served, HTTP)
    out["ping"] = HTTP.get(url + "/ping").status_code
    out["load"] = HTTP.get(url + "/load").json()
    print(f"api checks: {out}", flush=True)
    return out


def media_chats(url: str, served: str, HTTP: httpx.Client) -> dict:  # noqa: N803
    """A 720p image chat's time to first token (max_tokens 1, after one untimed: its image cached), a new
    image's (the ViT and the whole prefill), 4 of them at once, and a video chat (a 4 s 640x360 24 fps MP4 as
    a data: URL: decoded, sampled at 2 fps, the ViT, prefill)."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from worldserve.media.video import encode_mp4

    rng = np.random.default_rng(1)

    def jpeg_url() -> str:
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (720, 1280, 3), np.uint8)).save(buf, "JPEG", quality=90)
        return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()

    image, fresh = jpeg_url(), jpeg_url()
    ramp = np.linspace(0, 255, 640, dtype=np.float32)[None, None, :, None]  # [1, 1, W, 1] moving stripes
    frames = (ramp + 8 * np.arange(96, dtype=np.float32)[:, None, None, None]) % 256  # [96, 1, W, 1]
    frames = np.broadcast_to(frames, (96, 360, 640, 3)).astype(np.uint8)
    clip = encode_mp4(frames, 24)
    video = "data:video/mp4;base64," + base64.b64encode(clip).decode()

    def ask(kind: str, ref: str, max_tokens: int) -> tuple[int, float, dict]:
        part = {"type": kind, kind: {"url": ref}}
        body = {"model": served, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Describe it."}]}]}  # fmt: skip
        t0 = time.perf_counter()
        r = HTTP.post(url + "/v1/chat/completions", json=body, timeout=600)
        answer = r.json()
        return r.status_code, time.perf_counter() - t0, answer.get("usage") or {"error": answer.get("error")}

    out: dict = {}
    ask("image_url", image, 1)
    status, wall, usage = ask("image_url", image, 1)
    # (the same image and prompt again: the prefix and encoder caches hold it; the ViT does not run)
    out["image_720p_ttft"] = {"status": status, "s": wall, "prompt_tokens": usage.get("prompt_tokens")}
    status, wall, usage = ask("image_url", fresh, 1)  # an image never seen: the ViT and the whole prefill
    out["image_720p_ttft_new_image"] = {
        "status": status,
        "s": wall,
        "prompt_tokens": usage.get("prompt_tokens"),
    }
    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        rs = list(pool.map(lambda _: ask("image_url", image, 32), range(4)))
    out["image_720p_x4"] = {"statuses": sorted({r[0] for r in rs}), "wall_s": time.perf_counter() - t0,
                            "completion_tokens": sum(r[2].get("completion_tokens", 0) for r in rs)}  # fmt: skip
    status, wall, usage = ask("video_url", video, 32)
    out["video_4s"] = {"status": status, "s": wall, "mp4_bytes": len(clip), **usage}
    status, wall, usage = ask(
        "video_url", video, 32
    )  # again: decoded and encoded already (processor, encoder
    out["video_4s_again"] = {"status": status, "s": wall, **usage}  # and prefix caches)
    print(f"media chats: {out}", flush=True)
    return out
