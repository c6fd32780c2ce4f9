"""Chat content parts as vLLM reads them, on a real uvicorn (tiny Reasoner): bare strings, `input_text` /
`output_text` / `refusal` / `thinking` parts, the Responses API's `input_image`, type-less `image_url` /
`video_url` parts and URLs with surrounding spaces render the same prompt as the canonical parts (they were
400s); `media_io_kwargs.image.rgba_background_color` decides what transparent pixels show (it was ignored),
and what it cannot take is a 400 naming the field."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from worldserve.api.chat_media import media_parts
from worldserve.api.chat_protocol import ChatCompletionRequest

MODEL = "test-model"


def _png(rgba: tuple[int, int, int, int], size: int = 28) -> str:
    buf = io.BytesIO()
    Image.new("RGBA", (size, size), rgba).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _tokens(url: str, messages: list[dict], **body) -> list[int]:
    r = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_vllms_part_spellings_render_as_the_canonical_parts(reasoner_url):
    image = _png((200, 30, 30, 255))
    canonical = [
        {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                     {"type": "image_url", "image_url": {"url": image}}]},
        {"role": "assistant", "content": [{"type": "text", "text": "I will not."}]},
        {"role": "user", "content": [{"type": "text", "text": "Why"}, {"type": "text", "text": "not?"}]},
    ]  # fmt: skip
    spelled = [
        {"role": "user", "content": ["Look:", {"image_url": "  " + image + "\n"}]},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I will not."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Why"}, {"type": "output_text", "text": "not?"}]},
    ]  # fmt: skip
    want = _tokens(reasoner_url, canonical)
    assert _tokens(reasoner_url, spelled) == want
    responses_style = [{**canonical[0], "content": [{"type": "input_text", "text": "Look:"},
                                                    {"type": "input_image", "image_url": image}]}, *canonical[1:]]  # fmt: skip
    assert _tokens(reasoner_url, responses_style) == want
    thinking = [{"role": "user", "content": [{"type": "thinking", "thinking": "Why"}, "not?"]}]
    assert _tokens(reasoner_url, thinking) == _tokens(reasoner_url, [canonical[2]])
    for detail in ("auto", "low", "high", "original"):  # (the openai SDK's values: the same prompt)
        detailed = [{**canonical[0], "content": [canonical[0]["content"][0],
                                                 {"type": "image_url", "image_url": {"url": image, "detail": detail}}]},
                    *canonical[1:]]  # fmt: skip
        assert _tokens(reasoner_url, detailed) == want, detail


def test_urls_are_read_without_their_surrounding_spaces():
    """A leading space had hidden an http URL from the download step ("this server does not download")."""
    body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": " http://example.com/a.png "}},
        {"type": "video_url", "video_url": "\thttps://example.com/v.mp4"},
        {"video_url": {"url": "https://example.com/w.mp4\n"}},
    ]}]})  # fmt: skip
    assert [url for _, _, url in media_parts(body)] == [
        "http://example.com/a.png", "https://example.com/v.mp4", "https://example.com/w.mp4"
    ]  # fmt: skip


def _first_logprobs(url: str, image: str, **body) -> list[float]:
    chat = {"model": MODEL, "max_tokens": 1, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}],
            **body}  # fmt: skip
    r = httpx.post(url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    return [t["logprob"] for t in r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]]


def test_rgba_background_color_is_what_transparent_pixels_show(reasoner_url):
    clear = _png((0, 0, 0, 0))
    black = {"media_io_kwargs": {"image": {"rgba_background_color": [0, 0, 0]}}}
    on_white, on_black = _first_logprobs(reasoner_url, clear), _first_logprobs(reasoner_url, clear, **black)
    assert on_white == _first_logprobs(reasoner_url, _png((255, 255, 255, 255)))  # vLLM's default: white
    assert on_black == _first_logprobs(reasoner_url, _png((0, 0, 0, 255)))
    assert on_black != on_white


@pytest.mark.parametrize(
    ("media_io_kwargs", "param"),
    [
        ({"image": {"rgba_background_color": [0, 0]}}, "media_io_kwargs.image.rgba_background_color"),
        ({"image": {"rgba_background_color": [0, 0, 256]}}, "media_io_kwargs.image.rgba_background_color"),
        ({"image": {"rgba_background_color": "black"}}, "media_io_kwargs.image.rgba_background_color"),
        ({"image": {"nonsense": 1}}, "media_io_kwargs.image"),
        ({"image": [0, 0, 0]}, "media_io_kwargs.image"),
        ({"audio": {}}, "media_io_kwargs.audio"),
    ],
)
def test_media_io_kwargs_it_cannot_take_are_a_400_naming_the_field(reasoner_url, media_io_kwargs, param):
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}],
            "media_io_kwargs": media_io_kwargs}  # fmt: skip
    r = httpx.post(reasoner_url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_part_with_neither_type_nor_media_is_still_a_400(reasoner_url):
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [{"caption": "x"}]}]}
    r = httpx.post(reasoner_url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].type", r.text


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "image_url", "image_url": 5}, "messages[0].content[0].image_url"),
        ({"type": "image_url", "image_url": {"url": None}}, "messages[0].content[0].image_url.url"),
        ({"type": "bogus"}, "messages[0].content[0].type"),
        # (OpenAI's detail is auto / low / high / original: "ultra" was taken silently)
        (
            {"type": "image_url", "image_url": {"url": "data:,", "detail": "ultra"}},
            "messages[0].content[0].image_url.detail",
        ),
        # (a list or an object as the type had been a TypeError in the part's spelling check: a 500)
        ({"type": [], "text": "hi"}, "messages[0].content[0].type"),
        ({"type": {"a": 1}, "text": "hi"}, "messages[0].content[0].type"),
    ],
)
def test_a_malformed_part_is_a_400_naming_it(reasoner_url, part, param):
    """(pydantic's errors had named only `messages`; the semantic checks name the part already)"""
    chat = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": [part]}]}
    r = httpx.post(reasoner_url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
