"""POST /v1/chat/completions end to end on a real uvicorn: the Reasoner (tiny checkpoint) behind the real
`openai` client, streaming and not, image parts as data URLs and file:// paths, usage counts, and the 4xx
envelopes of bad requests. Video jobs (FakeBackend) run through the same engine and model lock meanwhile.
"""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from serving_helpers import serve_app, wait_until

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart

MODEL = "test-model"


def _png(seed: int = 0, h: int = 40, w: int = 56) -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def reasoner(tiny_ckpt):
    from transformers import AutoTokenizer

    from worldserve.runner.reasoner import Reasoner
    from worldserve.weights.loader import load_transformer

    model = load_transformer(tiny_ckpt, dtype=torch.float32, progress=False)
    tok = AutoTokenizer.from_pretrained(str(tiny_ckpt / "text_tokenizer"))
    return Reasoner.from_pretrained(tiny_ckpt, model, tok, max_model_len=4096)


@pytest.fixture(scope="module")
def server(reasoner, tmp_path_factory):
    from worldserve.api.app import build_app
    from worldserve.config import SchedulerConfig
    from worldserve.engine.client import EngineClient
    from worldserve.engine.engine import Engine
    from worldserve.engine.fake_backend import FakeBackend
    from worldserve.engine.jobs import JobStore

    root = tmp_path_factory.mktemp("chat")
    media = root / "media"
    media.mkdir()
    (media / "cat.png").write_bytes(_png(3))
    store = JobStore(root / "store")
    engine = Engine(FakeBackend(step_delay=0.002), store, SchedulerConfig(max_batch_size=1),
                    encoder=lambda *a, **k: b"FAKEMP4")  # fmt: skip
    client = EngineClient(engine, store, model_name=MODEL, max_queued_requests=16, chat_backend=reasoner)
    app = build_app(client, shutdown_timeout_s=1.0, allowed_local_media_path=str(media))
    with serve_app(app, name="test-chat-uvicorn") as url:
        yield url, media


@pytest.fixture(scope="module")
def oai(server):
    from openai import OpenAI

    return OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def _direct(reasoner, params: ChatParams) -> tuple[str, object]:
    session = reasoner.start(params)
    text = ""
    while session.finish_reason is None:
        text += session.step().text
    return text, session


def test_bad_words_are_tokenized_off_the_chat_worker_and_banned(oai, reasoner, monkeypatch):
    """bad_words over HTTP (chat and completions): their tokens come from the API's threads, never the chat
    worker's, which every running chat shares (60,000 words held them all up 7 s); the answer equals the
    Reasoner's own with the same words (the worker tokenizing them), and no longer holds the banned word."""
    import threading

    threads: list[str] = []
    tokenize = reasoner.prompts.bad_word_ids
    monkeypatch.setattr(reasoner.prompts, "bad_word_ids",
                        lambda words: threads.append(threading.current_thread().name) or tokenize(words))  # fmt: skip
    messages = [{"role": "user", "content": "Hello there"}]
    plain = oai.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True
    )
    word = plain.choices[0].logprobs.content[0].token  # the first token's text
    banned = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                         extra_body={"bad_words": [word, "zz"] * 5000})  # fmt: skip
    text, _ = _direct(reasoner, ChatParams(messages=(ChatMessage(role="user", content="Hello there"),), max_tokens=6,
                                           temperature=0, bad_words=(word, "zz")))  # fmt: skip
    assert banned.choices[0].message.content == text != plain.choices[0].message.content
    assert not text.startswith(word), (word, text)
    oai.completions.create(model=MODEL, prompt="Hello", max_tokens=2, extra_body={"bad_words": [word]})
    assert len(threads) == 4 and "worldserve-chat" not in threads, (
        threads
    )  # (two chats, _direct, a completion)


def test_a_temperature_above_2_samples_as_vllm_takes_it(oai):
    """OpenAI caps temperature at 2; vLLM takes any value >= 0 (a flatter distribution), and so do we."""
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                    temperature=3.5, seed=1)  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1


def test_non_stream_text_matches_the_reasoner(oai, reasoner):
    resp = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=6, temperature=0
    )
    text, session = _direct(
        reasoner,
        ChatParams(messages=(ChatMessage(role="user", content="Hello there"),), max_tokens=6, temperature=0),
    )
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == session.finish_reason
    u = resp.usage
    assert (u.prompt_tokens, u.completion_tokens) == (session.prompt_tokens, session.completion_tokens)
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens and 0 < u.completion_tokens <= 6


def test_the_answer_id_is_x_request_id_else_the_bodys_request_id(oai):
    """vLLM's `_base_request_id`: `chatcmpl-<X-Request-Id>`, else `chatcmpl-<request_id>` (a gateway joins its
    trace to the answer), streamed chunks too, `cmpl-` for text; `user` is typed as vLLM types it."""
    hi = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    r = oai.chat.completions.create(
        **hi, extra_headers={"X-Request-Id": "trace-abc"}, extra_body={"request_id": "b"}
    )
    assert r.id == "chatcmpl-trace-abc"
    assert oai.chat.completions.create(**hi, extra_body={"request_id": "body-xyz"}).id == "chatcmpl-body-xyz"
    chunks = list(oai.chat.completions.create(**hi, stream=True, extra_headers={"X-Request-Id": "s-1"}))
    assert chunks and {c.id for c in chunks} == {"chatcmpl-s-1"}
    a, b = (oai.chat.completions.create(**hi).id for _ in range(2))
    assert a != b and a.startswith("chatcmpl-") and len(a) > len("chatcmpl-") + 16
    text = oai.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "t-2"}
    )
    assert text.id == "cmpl-t-2"
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(**hi, extra_body={"user": 5})
    assert err.value.body["param"] == "user", err.value.body


def test_prompts_are_built_off_the_chat_worker_thread(oai, reasoner, monkeypatch):
    """The chat template, tokenization and media preprocessing of a chat run in the API's worker thread:
    on the chat worker's thread, which every running chat shares, a megabytes-long prompt held them all up
    while it tokenized (seconds at 5 MB)."""
    import threading

    threads = []
    build = reasoner.prompts.build

    def recording_build(params, **kw):
        threads.append(threading.current_thread().name)
        return build(params, **kw)

    monkeypatch.setattr(reasoner.prompts, "build", recording_build)
    resp = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=2,
        temperature=0.5,
        n=2,
        seed=1,
    )
    assert len(resp.choices) == 2 and threads and "worldserve-chat" not in threads
    assert len(threads) == 1  # once for the request: its n choices share the prompt


def test_stream_with_image_data_url(oai, reasoner):
    png = _png(0)
    parts = [
        {"type": "image_url", "image_url": {"url": _data_url(png)}},
        {"type": "text", "text": "What is it?"},
    ]
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_completion_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    msgs = (ChatMessage(role="user", content=(ChatPart(type="image", image=image),
                                               ChatPart(type="text", text="What is it?"))),)  # fmt: skip
    text, session = _direct(reasoner, ChatParams(messages=msgs, max_tokens=5, temperature=0))
    assert content == text
    usage = chunks[-1].usage
    assert usage.prompt_tokens == session.prompt_tokens > 60  # the image expanded to its merged patches
    assert usage.completion_tokens == session.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def _mp4(frames: int = 30, fps: float = 24.0) -> bytes:
    from worldserve.media.video import encode_mp4

    rng = np.random.default_rng(5)
    clip = rng.integers(0, 256, (frames, 9, 12, 3), dtype=np.uint8).repeat(8, axis=1).repeat(8, axis=2)
    return encode_mp4(clip, fps)  # frames x 72 x 96


@pytest.mark.parametrize(("media_io", "frames"), [(None, 4), ({"video": {"num_frames": 6}}, 6)])
def test_video_url_data_and_file(server, reasoner, media_io, frames):
    """A video_url part (data: URL, one wrapped into lines, then file://) answers what the Reasoner answers for the same decoded
    frames; media_io_kwargs changes the sampling."""
    from worldserve.chat_params import VideoSampling
    from worldserve.media.video_input import decode_chat_video

    url, media = server
    mp4 = _mp4()
    (media / "clip.mp4").write_bytes(mp4)
    sampling = VideoSampling() if media_io is None else VideoSampling(fps=None, num_frames=6)
    video = decode_chat_video(mp4, sampling)
    assert len(video.frames) == frames
    msgs = (ChatMessage(role="user", content=(ChatPart(type="video", video=video),
                                               ChatPart(type="text", text="What moves?"))),)  # fmt: skip
    text, session = _direct(reasoner, ChatParams(messages=msgs, max_tokens=4, temperature=0))
    wrapped = (
        "data:video/mp4;base64," + base64.encodebytes(mp4).decode()
    )  # MIME lines of 76 (vLLM takes them)
    for ref in (
        "data:video/mp4;base64," + base64.b64encode(mp4).decode(),
        wrapped,
        f"file://{media / 'clip.mp4'}",
    ):
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": ref}}, {"type": "text", "text": "What moves?"}]}]}  # fmt: skip
        if media_io is not None:
            body["media_io_kwargs"] = media_io
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["choices"][0]["message"]["content"] == text
        assert out["usage"]["prompt_tokens"] == session.prompt_tokens


def test_sse_wire_format_and_file_url(server):
    url, media = server
    body = {"model": MODEL, "stream": True, "max_tokens": 3, "temperature": 0.7, "seed": 1, "top_p": 0.9,
            "top_k": 20, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": f"file://{media / 'cat.png'}"}},
                {"type": "text", "text": "describe"}]}]}  # fmt: skip
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    first, last = payloads[0], payloads[-1]
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"] == {
        "role": "assistant", "content": ""}  # fmt: skip
    assert first["choices"][0]["finish_reason"] is None and "usage" not in first
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] in ("stop", "length")
    assert len({p["id"] for p in payloads}) == 1
    # same seed -> same text
    again = httpx.post(url + "/v1/chat/completions", json={**body, "stream": False}, timeout=60).json()
    streamed = "".join(p["choices"][0]["delta"].get("content", "") for p in payloads)
    assert again["choices"][0]["message"]["content"] == streamed
    assert again["choices"][0]["message"]["tool_calls"] == [] and again["prompt_logprobs"] is None


def test_http_image_url_is_downloaded(server):
    """An http(s) image_url is fetched by the server (api/media_urls.py) and answers as the same file does."""
    import functools
    import http.server
    import threading

    url, media = server
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media))
    handler.log_message = lambda *a: None
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    try:
        answers = []
        for ref in (f"http://127.0.0.1:{files.server_address[1]}/cat.png", f"file://{media / 'cat.png'}"):
            body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": ref}}, {"type": "text", "text": "describe"}]}]}  # fmt: skip
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append((r.json()["choices"][0]["message"]["content"], r.json()["usage"]["prompt_tokens"]))
        assert answers[0] == answers[1] and answers[0][1] > 60
        body["messages"][0]["content"][0]["image_url"]["url"] = (
            f"http://127.0.0.1:{files.server_address[1]}/no.png"
        )
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].image_url"
        assert "server returned HTTP 404" in r.json()["error"]["message"]
    finally:
        files.shutdown()


@pytest.mark.parametrize(
    ("patch", "status", "param", "needle"),
    [
        ({"messages": []}, 400, "messages", "validation error"),
        ({"max_tokens": int("9" * 4300)}, 400, "max_tokens", "cannot be greater than"),  # (the sum was a 500)
        ({"temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
        ({"n": 17}, 400, "n", "n must be between 1 and 16"),
        ({"n": 0}, 400, "n", "n must be between 1 and 16"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}]},
         400, "messages[0].content[1].text", "Missing required parameter"),  # (was rendered as empty text)
        ({"model": "nope"}, 404, "model", "The model `nope` does not exist."),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]},
         400, "messages[0].content[0].image_url", "base64"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]},
         400, "messages[0].content[0].image_url", "image"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}]}]},
         400, "messages[0].content[0].image_url", "failed to download image"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
         400, "messages[0].content[0].image_url", "must be a subpath"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": "http://127.0.0.1:9/a.mp4"}]}]},
         400, "messages[0].content[0].video_url", "failed to download video"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,aGVsbG8="}}]}]},
         400, "messages[0].content[0].video_url", "not a valid video"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": ""}}]}]},
         400, "messages[0].content[0].video_url", "video_url.url"),
        ({"media_io_kwargs": {"video": {"fps": 2, "max_duration": 0}}}, 400, "media_io_kwargs.video.max_duration",
         "must be a number of seconds"),
        ({"media_io_kwargs": {"video": {"fps": 2, "frame_recovery": True}}}, 400, "media_io_kwargs", "takes"),
        ({"media_io_kwargs": {"video": {"fps": -1}}}, 400, "media_io_kwargs", "fps must be > 0"),
        ({"media_io_kwargs": {"video": {"frames": 3}}}, 400, "media_io_kwargs", "takes"),
        ({"media_io_kwargs": {"video": {"fps": -(2**1100)}}}, 400, "media_io_kwargs", "fps must be > 0"),
        ({"mm_processor_kwargs": {"fps": -(2**1100)}}, 400, "mm_processor_kwargs", "fps must be > 0"),
        ({"max_tokens": 100000}, 400, "max_tokens", "max_tokens=100000 cannot be greater than max_model_len"),
        ({"max_completion_tokens": 40000}, 400, "max_completion_tokens", "max_completion_tokens=40000 cannot"),
        ({"max_tokens": 2, "max_completion_tokens": 40000}, 400, "max_completion_tokens", "=40000 cannot be"),
        ({"max_tokens": 4095}, 400, "input_tokens", "However, you requested 4095 output tokens"),
        ({"max_tokens": 40000, "max_completion_tokens": 2, "stream": True}, 200, None, None),
        ({"temperature": -1}, 400, "temperature", "validation error"),
        ({"presence_penalty": 2.5}, 400, "presence_penalty", "must be in [-2, 2]"),
        ({"repetition_penalty": 0}, 400, "repetition_penalty", "greater than zero"),
        ({"n": 2, "temperature": 0}, 400, "n", "n must be 1 when using greedy sampling, got 2."),
        ({"repetition_penalty": 2.5}, 200, None, None),  # (vLLM bounds it below only)
        ({"repetition_penalty": 1e-46}, 400, "repetition_penalty", "at least 1e-38"),  # (0 in float32)
        ({"top_logprobs": 3}, 400, "top_logprobs", "needs logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "validation error"),
        ({"response_format": {"type": "yaml"}}, 400, "response_format", "must be text, json_object"),
    ],
)  # fmt: skip
def test_bad_requests(server, patch, status, param, needle):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **patch}
    r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    if status == 200:  # max_completion_tokens wins over max_tokens (vLLM's rule)
        return
    err = r.json()["error"]
    assert err["code"] == status and err["param"] == param and needle in err["message"], err
    if status == 404:
        assert err["type"] == "NotFoundError"


def test_chat_and_video_share_the_engine(server):
    """A video job (20 fake denoise steps) and a chat run together through the one model lock."""
    with httpx.Client(base_url=server[0], timeout=60) as http:
        job = http.post("/v1/videos", json={"prompt": "a cat", "size": "32x32", "num_frames": 5,
                                            "num_inference_steps": 20}).json()  # fmt: skip
        r = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4, "ignore_eos": True,
                                                    "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert (
            r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        )  # (unseeded: no early stop)
        done = wait_until(
            lambda: http.get(f"/v1/videos/{job['id']}").json()["status"] in ("completed", "failed")
        )
        assert done and http.get(f"/v1/videos/{job['id']}").json()["status"] == "completed"
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == [MODEL]


def test_concurrent_chats_each_get_their_own_answer(server, reasoner):
    """Several chats in flight at once (batched decode steps on the server) answer what each answers alone."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = [f"Tell me about number {i}" for i in range(5)]

    def ask(prompt):
        body = {
            "model": MODEL,
            "max_tokens": 6,
            "temperature": 0,
            "messages": [{"role": "user", "content": prompt}],
        }
        r = httpx.post(server[0] + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers, strict=True):
        params = ChatParams(messages=(ChatMessage(role="user", content=prompt),), max_tokens=6, temperature=0)
        assert answer == _direct(reasoner, params)[0]


def test_logprobs_non_stream_and_stream(oai, reasoner):
    """logprobs / top_logprobs through the openai client: each token's raw-logit log-probability, equal to a
    direct computation from the Reasoner's logits; greedy picks the top alternative; the stream carries the
    same entries chunk by chunk."""
    msgs = [{"role": "user", "content": "Count to three."}]
    resp = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3)  # fmt: skip
    content = resp.choices[0].logprobs.content
    params = ChatParams(
        messages=(ChatMessage(role="user", content="Count to three."),), max_tokens=4, temperature=0
    )
    prompt = reasoner.build_prompt(params)
    hidden, cache, pos = reasoner.prefill(prompt)
    logits = reasoner.transformer.compute_logits(hidden[-1:])[0]
    _, session = _direct(reasoner, params)
    assert len(content) == session.completion_tokens
    for entry, token in zip(content, session.token_ids, strict=True):
        lp = torch.log_softmax(logits.float(), -1)
        assert entry.token == reasoner.tokenizer.decode([token]) and entry.bytes == list(entry.token.encode())
        assert abs(entry.logprob - float(lp[token])) < 1e-4
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        logits = reasoner.decode(token, cache, pos)
        pos += 1
    stream = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                         top_logprobs=3, stream=True)  # fmt: skip
    streamed = [
        e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_stream_and_not(oai, reasoner):
    """n > 1: n choices (choice i samples with seed + i), decoded batched; the stream interleaves them by
    index; usage counts the prompt once and every choice's tokens."""
    msgs = [{"role": "user", "content": "Name a color."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=5, temperature=1.0, seed=11)
    resp = oai.chat.completions.create(n=3, **kw)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    for i, c in enumerate(resp.choices):
        params = ChatParams(messages=(ChatMessage(role="user", content="Name a color."),), max_tokens=5,
                            temperature=1.0, seed=11 + i)  # fmt: skip
        text, session = _direct(reasoner, params)
        assert c.message.content == text and c.finish_reason == session.finish_reason
    assert resp.usage.prompt_tokens == session.prompt_tokens
    assert resp.usage.completion_tokens == sum(_direct(reasoner, ChatParams(
        messages=(ChatMessage(role="user", content="Name a color."),), max_tokens=5, temperature=1.0, seed=11 + i,
    ))[1].completion_tokens for i in range(3))  # fmt: skip
    chunks = list(oai.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)}  # fmt: skip
    assert texts == {i: c.message.content for i, c in enumerate(resp.choices)}
    finals = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finals == [0, 1, 2] and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_stop_string_is_reported_as_stop_reason(server):
    url = server[0]
    body = {"model": MODEL, "max_tokens": 30, "temperature": 1.0, "seed": 3,
            "messages": [{"role": "user", "content": "hello"}]}  # fmt: skip
    full = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert full["stop_reason"] is None
    text = full["message"]["content"]
    assert len(text) > 4, text
    stop = text[2:4]
    cut = httpx.post(url + "/v1/chat/completions", json={**body, "stop": [stop]}, timeout=60).json()[
        "choices"
    ][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert cut["message"]["content"] == text[: text.find(stop)]


@pytest.mark.parametrize(
    ("prefix", "kwargs", "param"),
    [
        ("{{ (100 / scale) | string }}", {"scale": 0}, "chat_template_kwargs"),  # ZeroDivisionError
        ("{% for i in range(10**6) %}{% endfor %}", {}, "messages"),  # OverflowError: the sandbox's cap
    ],
)
def test_any_failure_of_the_chat_template_is_a_400(reasoner, monkeypatch, prefix, kwargs, param):
    """The template is code run on the request: whatever it raises while rendering names the field that fed
    it (its variables, else the messages), never a 500."""
    from worldserve.params import ParamError

    tokenizer = reasoner.prompts.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", prefix + tokenizer.chat_template)
    params = ChatParams(messages=(ChatMessage(role="user", content="hi"),), chat_template_kwargs=kwargs)
    with pytest.raises(ParamError) as err:
        reasoner.build_prompt(params)
    assert err.value.param == param


def test_chats_with_media_being_decoded_leave_text_chats_their_threads(server, monkeypatch):
    """Chats carrying media are prepared on their own pool (media/work_pool.py `on_request_pool`), not on the
    event loop's default threads: while 40 image chats are stuck decoding, a text chat still answers."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from serving_helpers import png_bytes

    from worldserve.api import chat_media

    url, _ = server
    release, real = threading.Event(), chat_media.decode_image

    def stuck(data, **kw):
        release.wait(60)
        return real(data, **kw)

    monkeypatch.setattr(chat_media, "decode_image", stuck)
    image = "data:image/png;base64," + base64.b64encode(png_bytes(40, 24)).decode()
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "hi"}]
    with_image = {
        "model": MODEL,
        "max_tokens": 2,
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
    }
    text = {**with_image, "messages": [{"role": "user", "content": "hi"}]}
    with ThreadPoolExecutor(40) as clients:
        try:
            stuck_chats = [clients.submit(httpx.post, url + "/v1/chat/completions", json=with_image, timeout=90)
                           for _ in range(40)]  # fmt: skip
            time.sleep(1.0)
            assert not any(f.done() for f in stuck_chats)
            answer = httpx.post(url + "/v1/chat/completions", json=text, timeout=20)
            assert answer.status_code == 200, answer.text
        finally:
            release.set()
        assert all(f.result().status_code == 200 for f in stuck_chats)


def test_a_video_sent_as_jpeg_frames_in_one_data_url(server, reasoner):
    """vLLM's `data:video/jpeg;base64,<frame>,<frame>,...` video: the frames, sampled and resized as a
    clip's at 24 fps, answer what the Reasoner answers for them; a frame that is not base64 is a 400 naming
    the part."""
    from worldserve.chat_params import VideoSampling
    from worldserve.media.video_input import decode_chat_frames

    url, _ = server
    rng = np.random.default_rng(3)
    jpegs = []
    for _ in range(6):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (72, 96, 3), dtype=np.uint8)).save(buf, format="JPEG")
        jpegs.append(buf.getvalue())
    video = decode_chat_frames(jpegs, VideoSampling(), param="p")
    assert video.indices == (0, 2, 3, 5) and video.frames.shape == (
        4,
        *VideoSampling().frame_size(4, 72, 96),
        3,
    )
    msgs = (ChatMessage(role="user", content=(ChatPart(type="video", video=video),
                                               ChatPart(type="text", text="What moves?"))),)  # fmt: skip
    text, _ = _direct(reasoner, ChatParams(messages=msgs, max_tokens=4, temperature=0))
    frames = "data:video/jpeg;base64," + ",".join(base64.b64encode(j).decode() for j in jpegs)
    for ref, status in ((frames, 200), (frames + ",!!", 400)):
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": ref}}, {"type": "text", "text": "What moves?"}]}]}  # fmt: skip
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == "messages[0].content[0].video_url"
    body["messages"][0]["content"][0]["video_url"]["url"] = frames
    assert (
        httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"][
            "content"
        ]
        == text
    )


def test_images_past_the_pixel_cap_are_refused_before_decoding_whatever_their_tokens(server, monkeypatch):
    """A request's images may decode to MAX_REQUEST_PIXELS in all (a 10 kB one-bit PNG decodes to 9400 x
    9400): a low mm_processor_kwargs max_pixels lowers their tokens, not their decode, and /tokenize (no
    context budget) is capped too; the image past the cap is never decoded."""
    from worldserve.api import chat_media

    monkeypatch.setattr(chat_media, "MAX_REQUEST_PIXELS", 3000 * 2000 + 100)  # one 3000x2000 image fits
    url, _ = server
    decoded = []
    real = chat_media.decode_image
    monkeypatch.setattr(chat_media, "decode_image", lambda data, **kw: decoded.append(1) or real(data, **kw))
    buf = io.BytesIO()
    Image.new("RGB", (3000, 2000), (21, 90, 200)).save(buf, format="PNG")
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]
    small = {"mm_processor_kwargs": {"max_pixels": 65536}}
    r = httpx.post(url + "/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "max_tokens": 1, "messages": messages, **small})  # fmt: skip
    assert r.status_code == 200 and decoded == [1], r.text
    decoded.clear()
    for n, (route, body) in enumerate(
        (("/v1/chat/completions", {"max_tokens": 1, **small}), ("/tokenize", {}))
    ):
        # new bytes each time, and two different images: decoded ones stay in the processor cache, free to use
        # again (one image twice costs one decode when the first is cached before the second is counted)
        images = []
        for colour in ((200, 90, n), (201, 90, n)):
            buf = io.BytesIO()
            Image.new("RGB", (3000, 2000), colour).save(buf, format="PNG")
            url_of = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            images.append({"type": "image_url", "image_url": {"url": url_of}})
        two = [{"role": "user", "content": [images[0], {"type": "text", "text": "hi"}, images[1]]}]
        r = httpx.post(url + route, json={"model": MODEL, "messages": two, **body}, timeout=60)
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert err["param"] == "messages" and "images decode to 12,000,000 pixels" in err["message"], err
        assert len(decoded) <= 1, decoded  # (the two load at once: the first may decode; never the second)
        decoded.clear()


def test_images_that_alone_overflow_the_context_are_refused_before_decoding(server, monkeypatch):
    """Each image's tokens are counted from its header (its size and the pixel budget) before any pixel is
    decoded: images that alone overflow the context are a 400, nothing decoded (a few MB of PNGs decode to
    gigabytes); the same image under a small mm_processor_kwargs max_pixels fits and is decoded."""
    from worldserve.api import chat_media

    url, _ = server
    decoded = []
    real = chat_media.decode_image
    monkeypatch.setattr(chat_media, "decode_image", lambda data, **kw: decoded.append(1) or real(data, **kw))
    buf = io.BytesIO()
    Image.new("RGB", (3000, 2000), (20, 90, 200)).save(buf, format="PNG")  # ~30 KB; 5,828 tokens by default
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": [image, {"type": "text", "text": "hi"}]}]}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "the last messages[0].content[0].image_url" in err["message"], err
    assert decoded == []
    r = httpx.post(
        url + "/v1/chat/completions", json={**body, "mm_processor_kwargs": {"max_pixels": 65536}}, timeout=60
    )
    assert r.status_code == 200, r.text
    assert decoded == [1]
