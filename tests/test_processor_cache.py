"""The Reasoner's processor cache (media/processor_cache.py, `--mm-processor-cache-gb`): least recently used
out by bytes; the image preprocessor's cached patches equal fresh ones bit for bit (and the prompt built from
them is the same prompt); over real HTTP a conversation's repeated image and video are decoded once, a new
pixel budget resizes again from the decoded image, and /metrics counts vLLM's mm_cache queries and hits."""

from __future__ import annotations

import base64
import io
import re

import httpx
import numpy as np
import pytest
from PIL import Image

from worldserve.chat_params import ChatMessage, ChatParams, ChatPart
from worldserve.media.processor_cache import ProcessorCache, content_key
from worldserve.models.cosmos3.vision import ImagePreprocessor


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_least_recently_used_out_by_bytes_and_counted_lookups():
    c = ProcessorCache(100)
    c.put("a", 1, 40)
    c.put("b", 2, 40)
    assert c.get("a") == 1  # a is now the most recently used
    c.put("c", 3, 40)  # 120 bytes: b, the least recently used, goes
    assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3 and c.bytes == 80
    c.put("big", 4, 101)  # larger than the whole cache: not kept, nothing dropped for it
    assert c.get("big") is None and len(c) == 2
    c.put("a", 5, 10)  # the same key again: replaced, its bytes recounted
    assert c.get("a") == 5 and c.bytes == 50
    assert (c.queries, c.hits) == (6, 4)
    assert c.get("a", counted=False) == 5 and (c.queries, c.hits) == (6, 4)
    off = ProcessorCache(0)
    off.put("a", 1, 1)
    assert off.get("a") is None and len(off) == 0
    with pytest.raises(ValueError, match="max_bytes"):
        ProcessorCache(-1)
    assert content_key(b"x") != content_key(b"y") and content_key(b"x") == content_key(b"x")
    assert ProcessorCache(1).enabled and not off.enabled


def test_a_cache_that_keeps_nothing_hashes_nothing(monkeypatch):
    """--mm-processor-cache-gb 0 (and no cache at all): the media is decoded with no content key hashed (a
    video's SHA-256 alone is ~0.7 s a GiB)."""
    from worldserve.api import chat_media
    from worldserve.api.chat_messages import ContentPart
    from worldserve.chat_params import VideoSampling

    hashed = []
    monkeypatch.setattr(chat_media, "content_key", lambda data: hashed.append(data) or b"k")
    url = "data:image/png;base64," + base64.b64encode(_png(_image(24, 40, 9))).decode()
    content = ContentPart(type="image_url", image_url={"url": url})
    for cache in (None, ProcessorCache(0)):
        got = chat_media.part(content, "messages[0].content[0]", None, VideoSampling(), None, cache)
        assert got.image.shape == (24, 40, 3) and got.media_key is None
    assert hashed == []
    got = chat_media.part(
        content, "messages[0].content[0]", None, VideoSampling(), None, ProcessorCache(2**20)
    )
    assert got.media_key == b"k" and len(hashed) == 1


def test_cached_patches_equal_fresh_ones_and_are_resized_once():
    images = [_image(48, 80, 1), _image(70, 40, 2)]
    cache = ProcessorCache()
    pre = ImagePreprocessor(cache=cache)
    resized = []
    fresh = pre._patches
    pre._patches = lambda img, h, w: resized.append((h, w)) or fresh(img, h, w)
    plain = ImagePreprocessor()(images)
    for _ in range(2):
        out = pre(images, keys=[b"k1", b"k2"])
        assert out.patches.equal(plain.patches) and out.grid_thw.equal(plain.grid_thw)
        assert out.digests == plain.digests
    assert len(resized) == 2  # the second call resized nothing
    small = pre(images, keys=[b"k1", b"k2"], max_pixels=1024)  # a new size: resized again, then kept
    assert small.patches.equal(ImagePreprocessor()(images, max_pixels=1024).patches)
    assert len(resized) == 4
    none = pre([])
    assert none.patches.shape == (0, 3 * 16 * 16) and none.grid_thw.shape == (0, 3) and none.digests == ()
    pre(images, keys=[b"k1", None])  # an image without a key is never cached
    assert len(resized) == 5 and (cache.queries, cache.hits) == (0, 0)  # (later stages count no items)


def test_a_prompt_from_cached_media_is_the_same_prompt(reasoner):
    arr = _image(40, 56, 3)
    key = content_key(_png(arr))
    params = [
        ChatParams(
            messages=(
                ChatMessage(
                    role="user",
                    content=(
                        ChatPart(type="image", image=arr, media_key=k),
                        ChatPart(type="text", text="What is it?"),
                    ),
                ),
            ),
            max_tokens=4,
        )  # fmt: skip
        for k in (None, key, key)
    ]
    plain, first, cached = (reasoner.prompts.build(p) for p in params)
    for p in (first, cached):
        assert (
            p.input_ids == plain.input_ids and p.positions.equal(plain.positions) and p.media == plain.media
        )
        assert p.vision.patches.equal(plain.vision.patches)


def test_a_conversation_decodes_its_image_and_video_once(reasoner, reasoner_url, monkeypatch):
    from worldserve.api import chat_media
    from worldserve.media.video import encode_mp4

    decoded = []
    for name in ("decode_image", "decode_chat_video"):
        real = getattr(chat_media, name)
        monkeypatch.setattr(
            chat_media, name, lambda *a, _f=real, _n=name, **k: decoded.append(_n) or _f(*a, **k)
        )
    frames = np.random.default_rng(4).integers(0, 256, (6, 64, 96, 3), dtype=np.uint8)
    clip = encode_mp4(frames, fps=8.0, audio=None)
    image = "data:image/png;base64," + base64.b64encode(_png(_image(40, 56, 5))).decode()
    video = "data:video/mp4;base64," + base64.b64encode(clip).decode()
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "video_url", "video_url": {"url": video}},
               {"type": "text", "text": "What happens?"}]  # fmt: skip
    cache = reasoner.media_cache
    queries, hits = cache.queries, cache.hits

    def chat(**extra):
        body = {"model": "test-model", "messages": [{"role": "user", "content": content}], "max_tokens": 4,
                "temperature": 0, **extra}  # fmt: skip
        r = httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    first, again = chat(), chat()
    assert sorted(decoded) == ["decode_chat_video", "decode_image"]  # the second request decoded nothing
    assert again["choices"][0]["message"] == first["choices"][0]["message"]
    assert again["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert (cache.queries - queries, cache.hits - hits) == (4, 2)
    smaller = chat(mm_processor_kwargs={"max_pixels": 1024})  # the decoded image, resized anew
    assert len(decoded) == 2
    assert smaller["usage"]["prompt_tokens"] < first["usage"]["prompt_tokens"]
    metrics = httpx.get(reasoner_url + "/metrics").text
    found = {m: float(v) for m, v in re.findall(r"^vllm:(mm_cache_\w+)_total\{[^}]*\} (\S+)$", metrics, re.M)}
    assert found == {"mm_cache_queries": cache.queries, "mm_cache_hits": cache.hits}


def test_concurrent_chats_share_the_cached_media(reasoner, reasoner_url):
    """Twelve chats at once on two images (each chat both, in either order): each answers as the chat of its
    order alone did, and every image of every chat came from the cache (the two chats alone put them there)."""
    from concurrent.futures import ThreadPoolExecutor

    urls = ["data:image/png;base64," + base64.b64encode(_png(_image(36, 60, s))).decode() for s in (7, 8)]

    def chat(k: int) -> tuple[str, int]:
        pair = urls if k % 2 else urls[::-1]
        content = [{"type": "image_url", "image_url": {"url": u}} for u in pair] + [
            {"type": "text", "text": "?"}
        ]
        body = {"model": "test-model", "messages": [{"role": "user", "content": content}], "max_tokens": 3,
                "temperature": 0}  # fmt: skip
        r = httpx.post(reasoner_url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return k % 2, r.json()["choices"][0]["message"]["content"]

    alone = dict(chat(k) for k in (0, 1))
    hits = reasoner.media_cache.hits
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(chat, range(12)))
    assert all(text == alone[order] for order, text in answers)
    assert reasoner.media_cache.hits - hits == 24  # every image of every chat found decoded


@pytest.mark.parametrize(("h", "w", "budget"), [(48, 80, {}), (700, 1300, {}), (2000, 3000, {"max_pixels": 65536}),
                                                (20, 20, {"min_pixels": 4096})])  # fmt: skip
def test_an_images_token_count_from_its_size_is_its_prompts(h, w, budget):
    """ImagePreprocessor.tokens (the API's count before decoding) equals the tokens its patches make."""
    pre = ImagePreprocessor()
    inputs = pre([_image(h, w, 0)], **budget)
    assert pre.tokens(h, w, **budget) == int(inputs.grid_thw.prod()) // pre.merge_size**2
