"""worldserve.Engine, the offline Python API, on the tiny random checkpoint (CPU, float32): T2V and I2V MP4s
decoded back with PyAV, chats (whole and streamed, an image part read as the HTTP route reads it), calls from
several threads running in the engine together, bad fields named, close() twice, the context manager, and an
interpreter that exits with an Engine left open.
"""

from __future__ import annotations

import ast
import base64
import io
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from media_probe import probe_mp4
from offline_engines import TINY, engine_fixture, served_fixture
from serving_helpers import png_bytes

engine = engine_fixture()


served = served_fixture()


def test_text_and_image_to_video_mp4s(engine, tmp_path):
    """T2V and I2V (the image as an array and as PNG bytes) give MP4s with H.264 and AAC 48 kHz stereo, the
    seed and stage timings reported, `save` writing the same bytes."""
    t2v = engine.generate_video("A red fox runs through fresh snow", seed=7, **TINY)
    p = probe_mp4(t2v.video, decode=True)
    assert (p.video_codec, p.width, p.height, p.num_frames, p.fps) == ("h264", 64, 64, 5, 8)
    assert (p.audio_codec, p.sample_rate, p.channels) == ("aac", 48000, 2)
    assert t2v.seed == 7 and t2v.params.num_inference_steps == 2
    assert {"prepare", "diffuse", "vae.decode", "encode"} <= set(t2v.stage_seconds)
    t2v.save(tmp_path / "fox.mp4")
    assert (tmp_path / "fox.mp4").read_bytes() == t2v.video
    # a save that fails midway (a full disk found at the fsync) leaves the older file whole, no partial one
    import errno
    import os

    from worldserve.media import atomic_write

    (tmp_path / "fox.mp4").write_bytes(b"older")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(atomic_write.os, "fsync", full)
        with pytest.raises(OSError, match="No space left"):
            t2v.save(tmp_path / "fox.mp4")
    assert (tmp_path / "fox.mp4").read_bytes() == b"older" and os.listdir(tmp_path) == ["fox.mp4"]

    first = p.frames[-1]
    from_array = engine.generate_video("The fox turns around", image=first, **TINY)
    from_png = engine.generate_video(
        "The fox turns around", image=png_bytes(80, 48), generate_sound=False, **TINY
    )
    assert probe_mp4(from_array.video).num_frames == 5
    png = probe_mp4(from_png.video)
    assert (png.video_codec, png.num_frames, png.audio_codec) == ("h264", 5, None)
    assert from_array.params.image is not None and from_array.params.image.shape == first.shape
    # a VideoParams item's image in any form image= takes (it had to be an array there)
    from worldserve import VideoParams

    item = VideoParams(prompt="The fox turns around", image=png_bytes(80, 48), generate_sound=False, **TINY)
    assert engine.generate_video([item])[0].video == from_png.video


def test_mp4_is_the_servers_for_the_same_request(engine, served, tmp_path):
    """The Engine's MP4 is byte for byte what POST /v1/videos/sync answers for the same fields from the
    pipeline a server loads for the same options: the same params, encoder and encode options."""
    import asyncio

    from serving_helpers import asgi_server

    async def sync_route() -> bytes:
        async with asgi_server(tmp_path, backend=served[0], real_encoder=True) as http:
            fields = {"prompt": "a cat", "size": "64x64", "num_frames": "5", "num_inference_steps": "2",
                      "fps": "8", "seed": "5"}  # fmt: skip
            r = await http.post("/v1/videos/sync", data=fields)
            assert r.status_code == 200, r.text
            return r.content

    assert engine.generate_video("a cat", seed=5, **TINY).video == asyncio.run(sync_route())


def test_chat_and_stream_chat(engine):
    """A greedy chat and the same chat streamed give the same text; usage counts the tokens; an image part
    (a base64 data: URL, as the HTTP route takes it) reaches the Reasoner's prompt."""
    messages = [{"role": "user", "content": "Describe a fox."}]
    answer = engine.chat(messages, max_tokens=6, temperature=0)
    assert answer.finish_reason == "length" and answer.usage.completion_tokens == 6
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 6 and len(answer.token_ids) == 6
    # (one sample: outputs holds it, text & co. are its own)
    assert [(c.index, c.text, c.token_ids) for c in answer.outputs] == [(0, answer.text, answer.token_ids)]
    pieces = list(engine.stream_chat(messages, max_tokens=6, temperature=0))
    assert "".join(pieces) == answer.text and len(pieces) > 1

    from worldserve import ChatParams

    # a whole ChatParams instead of sampling fields: the same greedy answer
    assert engine.chat(messages, ChatParams(max_tokens=6, temperature=0)).text == answer.text
    # a stream left early cancels its chat: nothing stays running in the engine
    stream = engine.stream_chat(messages, max_tokens=500, temperature=0)
    next(stream)
    stream.close()
    deadline = time.monotonic() + 60
    while engine.num_unfinished_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.num_unfinished_requests == 0

    url = "data:image/png;base64," + base64.b64encode(png_bytes(64, 64)).decode()
    seen = engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                     {"type": "text", "text": "Describe a fox."}]}],
                       max_tokens=2, temperature=0)  # fmt: skip
    assert seen.usage.prompt_tokens > answer.usage.prompt_tokens  # (the image's vision tokens)
    # vLLM's offline spelling of an image part: a PIL image, read as that PNG
    from PIL import Image

    pil = Image.open(io.BytesIO(png_bytes(64, 64)))
    same = engine.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": pil},
                                                     {"type": "text", "text": "Describe a fox."}]}],
                       max_tokens=2, temperature=0)  # fmt: skip
    assert (same.usage.prompt_tokens, same.text) == (seen.usage.prompt_tokens, seen.text)


def test_threads_run_in_the_engine_together(engine):
    """Two generate_video calls from two threads are both in the engine at once (with the model held, neither
    can finish: a lock around whole calls would keep the second out), then each gets its own result."""
    results: dict[int, object] = {}

    def generate(i: int) -> None:
        results[i] = engine.generate_video(f"prompt {i}", seed=i, **TINY)

    threads = [threading.Thread(target=generate, args=(i,)) for i in range(2)]
    # (private: holding the engine's model is the only way, short of a timing race, to keep both requests
    # unfinished while num_unfinished_requests, the public count, is read; the Engine offers no such hook)
    model_lock = engine._parts.client.engine.model_lock
    with model_lock:  # (the engine's model calls wait)
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while engine.num_unfinished_requests < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # (2, or 3 while the engine counts a pair it admitted together as both running and one still waiting)
        assert engine.num_unfinished_requests >= 2
    for t in threads:
        t.join(300)
    assert [results[i].seed for i in range(2)] == [0, 1]
    assert [results[i].prompt for i in range(2)] == ["prompt 0", "prompt 1"]
    assert results[0].video != results[1].video
    assert engine.num_unfinished_requests == 0


def test_bad_inputs_name_the_field(engine):
    from worldserve import ParamError

    with pytest.raises(ParamError, match="width=65") as bad:
        engine.generate_video("a fox", **{**TINY, "width": 65})
    # (the keyword passed, where VideoParams names the HTTP field, `size`)
    assert isinstance(bad.value, ValueError) and bad.value.param == "width"
    with pytest.raises(ParamError) as bad:
        engine.generate_video("a fox", steps=2)
    assert bad.value.param == "steps"
    with pytest.raises(ParamError) as bad:
        engine.generate_video("a fox", image="/no/such/image.png", **TINY)
    assert bad.value.param == "image"
    with pytest.raises(ParamError) as bad:
        engine.chat("hi", temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(ParamError) as bad:
        engine.chat("hi", max_tokenz=3)
    assert bad.value.param == "max_tokenz"
    with pytest.raises(ParamError) as bad:
        broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        engine.chat([{"role": "user", "content": [broken]}])
    assert bad.value.param == "messages[0].content[0].image_url"
    with pytest.raises(ParamError, match=r"n=2: stream_chat yields one answer's text.*chat\(\)") as bad:
        list(engine.stream_chat("hi", n=2))
    assert bad.value.param == "n"


def test_n_and_best_of_refusals(engine):
    """n past the route's 1..16, or n > 1 greedy, is the route's ParamError naming `n` (with a ChatParams too:
    its temperature decides); best_of is refused with what to do instead; n beside a ChatParams is no
    sampling field dropped in silence, other fields still are refused."""
    from worldserve import ChatParams, ParamError
    from worldserve.offline.outputs import ChatOutput, ChatUsage

    for fields in ({"n": 17}, {"n": 0}, {"n": 2, "temperature": 0}):
        with pytest.raises(ParamError) as bad:
            engine.chat("hi", max_tokens=2, **fields)
        assert bad.value.param == "n", fields
    for n in (17, 2):
        with pytest.raises(ParamError, match="greedy" if n == 2 else "between 1 and 16") as bad:
            engine.chat("hi", ChatParams(max_tokens=2, temperature=0.0), n=n)
        assert bad.value.param == "n"
    with pytest.raises(ParamError, match="pass n and choose among") as bad:
        engine.chat("hi", best_of=2)
    assert bad.value.param == "best_of"
    # what the ChatOutput cannot carry is refused, as keywords or in a ChatParams (it was computed and dropped)
    for fields in ({"logprobs": True, "top_logprobs": 2}, {"prompt_logprobs": 1}, {"echo": True}):
        with pytest.raises(ParamError, match="carries no logprobs") as bad:
            engine.chat("hi", max_tokens=2, **fields)
        assert bad.value.param == next(iter(fields)), fields
    with pytest.raises(ParamError, match="carries no logprobs") as bad:
        engine.chat("hi", ChatParams(max_tokens=2, logprobs=True))
    assert bad.value.param == "logprobs"
    bad_image = [{"role": "user", "content": [{"type": "image_pil", "image_pil": "notanimage"}, "x"]}]
    with pytest.raises(ParamError, match="must be a PIL image, got str") as bad:  # (an AttributeError)
        engine.chat(bad_image, max_tokens=2)
    assert bad.value.param == "messages[0].content[0].image_pil"
    with pytest.raises(TypeError, match=r"got params and max_tokens\)"):
        engine.chat("hi", ChatParams(max_tokens=2), max_tokens=3, n=2)
    with pytest.raises(ValueError, match="at least one sample"):
        ChatOutput(outputs=(), usage=ChatUsage(prompt_tokens=1, completion_tokens=0))
    assert engine.num_unfinished_requests == 0


def test_n_samples_are_the_chat_routes_choices(engine, served, tmp_path):
    """chat(n=3, seed=11) gives byte for byte the choices POST /v1/chat/completions answers for the same body
    (sample i seeded seed + i, on a server's own load of the same options): their texts, endings and token
    ids in index order, `text` & co. the first's, the route's usage (the prompt once, every sample's tokens).
    A list of conversations gives each one the route's choices; n beside a ChatParams the same samples."""
    import asyncio

    from serving_helpers import asgi_server

    from worldserve import ChatParams

    fields = {"max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3, "return_token_ids": True}
    fox = [{"role": "user", "content": "Describe a fox."}]
    cat = [{"role": "user", "content": "Describe a cat."}]

    async def chat_route() -> list[dict]:
        async with asgi_server(tmp_path, backend=served[0], chat_backend=served[2]) as http:
            answers = []
            for messages in (fox, cat):
                r = await http.post("/v1/chat/completions", json={"messages": messages, **fields})
                assert r.status_code == 200, r.text
                answers.append(r.json())
            return answers

    def choices(answer: dict) -> list[tuple]:
        return [(c["index"], c["message"]["content"], c["finish_reason"], c["stop_reason"], tuple(c["token_ids"]))
                for c in answer["choices"]]  # fmt: skip

    def samples(output) -> list[tuple]:
        return [(c.index, c.text, c.finish_reason, c.stop_reason, c.token_ids) for c in output.outputs]

    routed = asyncio.run(chat_route())
    out = engine.chat(fox, **fields)
    assert samples(out) == choices(routed[0]) and len(out.outputs) == 3
    assert len({c.token_ids for c in out.outputs}) == 3  # (three samples, not one thrice)
    # (text & co.: the first sample's)
    assert (out.text, out.finish_reason, out.stop_reason, out.token_ids) == samples(out)[0][1:]
    counts = (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens)
    assert counts == tuple(
        routed[0]["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")
    )
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.outputs)
    batch = engine.chat([fox, cat], **fields)
    assert [samples(answer) for answer in batch] == [choices(answer) for answer in routed]
    sampling = ChatParams(max_tokens=5, temperature=1.0, seed=11)
    assert engine.chat(fox, sampling, n=3).outputs == out.outputs


def test_unknown_options_are_refused_before_loading():
    from worldserve import Engine

    with pytest.raises(TypeError, match="max_batch"):
        Engine(None, max_batch=2)
    with pytest.raises(TypeError, match="HTTP server"):
        Engine(None, port=8000)
    with pytest.raises(ValueError, match="--max-batch-size"):
        Engine(None, max_batch_size=0)


def test_close_twice_context_manager_and_exit_without_close(tiny_ckpt, tmp_path):
    """In a fresh interpreter: `with Engine(...)` closes it (a later call is a RuntimeError, close() again
    nothing); `Engine.from_config` works the same; an Engine left open does not hold the exit, and leaves no
    storage folder behind."""
    script = textwrap.dedent(f"""
        import tempfile
        from worldserve import Engine, EngineConfig
        from worldserve.config import ModelConfig, ReasonerConfig

        with Engine({str(tiny_ckpt)!r}, device="cpu", dtype="float32", max_model_len=1024) as engine:
            print(engine.chat("hi", max_tokens=2).finish_reason)
        engine.close()
        try:
            engine.chat("hi", max_tokens=2)
        except RuntimeError as exc:
            print("after close:", exc)
        config = EngineConfig(model=ModelConfig(model={str(tiny_ckpt)!r}, device="cpu", dtype="float32"),
                              reasoner=ReasonerConfig(max_model_len=1024))
        left_open = Engine.from_config(config)
        print(left_open.generate_video("a fox", width=32, height=32, num_frames=5, num_inference_steps=1).seed)
        print("leaving")
    """)
    env = {"TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    import os

    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})  # fmt: skip
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert run.stdout.split("\n")[:4] == ["length", "after close: this Engine is closed", "42", "leaving"]
    assert not list(tmp_path.glob("worldserve-offline-*"))


def test_only_front_ends_import_the_offline_engine():
    """The offline Engine sits beside the HTTP layer, over the engine: engine/, runner/, api/ and media/
    never import it (it may reuse api/'s request parsing; the engine side never imports api/)."""
    package = Path(__file__).resolve().parents[1] / "worldserve"
    offenders = []
    for folder in ("engine", "runner", "api", "media", "models", "sampling"):
        for path in sorted((package / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    names.append(node.module)
                banned = ["worldserve.offline"] + (
                    ["worldserve.api"] if folder in ("engine", "runner") else []
                )
                offenders += [f"{path.relative_to(package)} imports {n}" for n in names
                              if any(n == b or n.startswith(b + ".") for b in banned)]  # fmt: skip
    assert not offenders, "; ".join(offenders)
