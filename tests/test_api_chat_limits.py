"""Limits of chat requests on a real uvicorn (the tiny Reasoner): video sampling options out of range are a 400
naming `media_io_kwargs` / `mm_processor_kwargs` as the request is read (before any download; never a 500 from
a float overflow or an infinite frame count), a fps above the clip's own rate takes every frame, a text
with more bytes than the context can hold is refused by its byte count, untokenized (tens of seconds before),
and a prompt and budget past the context get vLLM's current renderer refusal, word for word.
"""

from __future__ import annotations

import base64

import httpx
import pytest
from serving_helpers import mp4_bytes

MODEL = "test-model"


HUGE = 2**1100
"""An integer past float's range: float(HUGE) raises OverflowError."""


@pytest.mark.parametrize(
    ("options", "param", "needle"),
    [
        ({"media_io_kwargs": {"video": {"fps": 0}}}, "media_io_kwargs", "fps must be > 0"),
        ({"media_io_kwargs": {"video": {"fps": -HUGE}}}, "media_io_kwargs", "fps must be > 0"),
        ({"mm_processor_kwargs": {"videos_kwargs": {"fps": -1e308}}}, "mm_processor_kwargs", "fps must be > 0"),
        ({"media_io_kwargs": {"video": {"fps": True}}}, "media_io_kwargs", "fps must be a number"),
        ({"media_io_kwargs": {"video": {"num_frames": HUGE}}}, "media_io_kwargs", "num_frames must be in [1, 768]"),
        ({"media_io_kwargs": {"video": {"num_frames": 0}}}, "media_io_kwargs", "num_frames must be in [1, 768]"),
        ({"mm_processor_kwargs": {"num_frames": -HUGE}}, "mm_processor_kwargs", "num_frames must be in [1, 768]"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_video_sampling_out_of_range_is_a_400_as_the_request_is_read(
    reasoner_url, options, param, needle, route
):
    """fps must be a number > 0 and num_frames an integer in [1, 768] (-1: the default), on chat and on
    /tokenize's chat form; checked before any media is fetched (the video's URL here would fail to
    download), never a 500 (float() overflowed on -2**1100)."""
    video = {"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/a.mp4"}}
    messages = [{"role": "user", "content": [video, {"type": "text", "text": "hi"}]}]
    body = {"model": MODEL, "messages": messages, **options} | (
        {"max_tokens": 2} if route != "/tokenize" else {}
    )
    r = httpx.post(reasoner_url + route, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"], err
    assert len(err["message"]) < 300  # a 332-digit number is not echoed whole


def test_video_fps_above_the_source_rate_takes_every_frame(reasoner_url):
    """Any fps at or above a 2 s clip's own 8 fps takes every frame (the same prompt as asking for 8 fps),
    2**1100 and 1e308 too (taken as MAX_VIDEO_FPS: float() overflowed on the one, the other made an
    infinite frame count: 500s once). vLLM's loader option `max_duration` is taken and, as vLLM's default
    loader does, not used (a 1 s limit on the 2 s clip changes nothing)."""
    mp4 = "data:video/mp4;base64," + base64.b64encode(mp4_bytes(frames=16, width=32, height=32)).decode()
    counts = []
    for video in ({"fps": 1000}, {"fps": HUGE}, {"fps": 1e308}, {"fps": 8}, {"fps": 8, "max_duration": 1}):
        body = {"model": MODEL, "max_tokens": 1, "media_io_kwargs": {"video": video}, "messages": [
            {"role": "user", "content": [{"type": "video_url", "video_url": {"url": mp4}}]}]}  # fmt: skip
        r = httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        counts.append(r.json()["usage"]["prompt_tokens"])
    assert len(set(counts)) == 1, counts


def test_video_sampling_indices_stay_finite():
    """VideoSampling.indices with the largest fps on a clip whose stated rate is tiny: the product is huge
    but the count is capped, never int(inf); validate() refuses a NaN, an infinite or a non-positive fps."""
    from worldserve.chat_params import VideoSampling
    from worldserve.params import ParamError

    assert VideoSampling(fps=1000.0).validate().indices(48, 1e-306) == list(range(48))  # 4.8e310: inf
    assert len(VideoSampling(fps=1000.0).indices(10_000, 1e-9)) == 768
    for fps in (float("nan"), float("inf"), 0.0, -1.0, 1000.5):
        with pytest.raises(ParamError):
            VideoSampling(fps=fps).validate()


def test_a_text_longer_than_the_context_can_hold_is_refused_untokenized(reasoner_url, reasoner, monkeypatch):
    """A chat text with more bytes than max_model_len tokens can hold is refused by its byte count (a 400
    naming `messages` in vLLM's words), not tokenized first (28.6 MiB took 35 s); a text that may fit still
    gets tokenized, and the refusal is the context's, as for a long prompt."""
    calls = []
    encode = reasoner.prompts.encode
    monkeypatch.setattr(reasoner.prompts, "encode", lambda *a, **k: calls.append(1) or encode(*a, **k))
    for content in (
        "hello " * 1_000_000,
        [{"type": "text", "text": "hi "}, {"type": "text", "text": "x" * 2_000_000}],
    ):
        body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": content}]}
        r = httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and "maximum context length is 4096 tokens" in err["message"], err
        assert "bytes in the messages" in err["message"] and calls == []
    fits = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hello " * 5000}]}
    r = httpx.post(
        reasoner_url + "/v1/chat/completions", json=fits, timeout=60
    )  # under the bound: tokenized, too long
    assert r.status_code == 400 and calls == [1] and r.json()["error"]["param"] == "input_tokens", r.text
    assert "requested 1 output tokens and your prompt contains" in r.json()["error"]["message"]


def test_more_messages_than_the_context_has_tokens_are_refused_before_validation(reasoner_url, monkeypatch):
    """Each message takes at least a token: 4,097 of them cannot fit the 4,096-token context, a 400 naming
    the field before pydantic builds an object of each (2.3 M messages in 67 MB took 2.6 GB and held the
    event loop 7 s); a large body that may fit is validated off the event loop."""
    import threading

    from worldserve.api.chat_protocol import ChatCompletionRequest

    many = [{"role": "user", "content": "a"}] * 4097
    for route, body, field in (
        ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1, "messages": many}, "messages"),
        ("/v1/responses", {"model": MODEL, "max_output_tokens": 1, "input": many}, "input"),
        ("/tokenize", {"model": MODEL, "messages": many}, "messages"),
    ):
        r = httpx.post(reasoner_url + route, json=body, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and "4,097 items" in err["message"] and "4,096 tokens" in err["message"]
    threads = []
    validate = ChatCompletionRequest.model_validate.__func__

    def recording(cls, data, *a, **k):
        threads.append(threading.current_thread().name)
        return validate(cls, data, *a, **k)

    monkeypatch.setattr(ChatCompletionRequest, "model_validate", classmethod(recording))
    small = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    large = {**small, "messages": [{"role": "user", "content": "hi"}], "metadata": "x" * (2 << 20)}
    for body in (small, large):
        assert httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
    assert len(threads) == 2 and threads[0] != threads[1], threads  # (the loop's thread, then a worker's)


VLLM_CONTEXT = (
    "This model's maximum context length is 4096 tokens. However, you requested {out} output tokens and your "
    "prompt contains {n} input tokens, for a total of {total} tokens. Please reduce the length of the input "
    "prompt or the number of requested output tokens. (parameter=input_tokens, value={n})"
)
"""vLLM's renderer refusal of a prompt and budget past the context (its VLLMValidationError's text)."""


def test_a_prompt_and_budget_past_the_context_get_vllm_s_current_refusal(reasoner_url):
    """Chat (streamed or not) and text completions: a prompt plus max_tokens over max_model_len is vLLM's
    renderer 400 word for word (type, param `input_tokens`, code), the exact prompt count (the /tokenize
    count: the prompt the chat renders); no budget sent counts 0; a budget past the whole context is refused
    before the prompt, naming the field sent."""
    messages = [{"role": "user", "content": "hello " * 300}]
    n = httpx.post(
        reasoner_url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=60
    ).json()["count"]
    out = 4097 - n + 5
    for stream in (False, True):
        body = {"model": MODEL, "messages": messages, "max_completion_tokens": out, "stream": stream}
        r = httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        message = VLLM_CONTEXT.format(out=out, n=n, total=n + out)
        assert r.json() == {"error": {"message": message, "type": "BadRequestError", "param": "input_tokens",
                                      "code": 400}}  # fmt: skip
    long = [{"role": "user", "content": "hello " * 5000}]
    r = httpx.post(reasoner_url + "/v1/chat/completions", json={"model": MODEL, "messages": long}, timeout=60)
    assert r.status_code == 400 and "requested 0 output tokens" in r.json()["error"]["message"], r.text
    r = httpx.post(reasoner_url + "/v1/completions", json={"model": MODEL, "prompt": [5] * 4000, "max_tokens": 100},
                   timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": VLLM_CONTEXT.format(out=100, n=4000, total=4100),
                                 "type": "BadRequestError", "param": "input_tokens", "code": 400}  # fmt: skip
    for route, body in (
        ("/v1/chat/completions", {"messages": messages}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        r = httpx.post(reasoner_url + route, json={"model": MODEL, "max_tokens": 5000, **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {"message": "max_tokens=5000 cannot be greater than max_model_len=max_total_tokens"
                                     "=4096. Please request fewer output tokens. (parameter=max_tokens, value=5000)",
                                     "type": "BadRequestError", "param": "max_tokens", "code": 400}  # fmt: skip
    # the whole context, exactly: taken
    fits = {"model": MODEL, "prompt": [5] * 4090, "max_tokens": 6}
    assert httpx.post(reasoner_url + "/v1/completions", json=fits, timeout=60).status_code == 200
