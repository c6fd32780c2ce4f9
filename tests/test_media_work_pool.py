"""The media pool (media/work_pool.py): results in order, the first failure in order raised, items truly run at
once; a chat request's images are decoded on it with the same result as one by one, and the error of a
request with two bad images names the first."""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest
from PIL import Image

from worldserve.api.chat import build_params
from worldserve.api.chat_protocol import ChatCompletionRequest
from worldserve.media import work_pool
from worldserve.media.work_pool import map_in_order
from worldserve.params import ParamError


def test_results_in_order_first_failure_in_order_and_at_once():
    assert map_in_order(lambda x: x * x, [3, 1, 2]) == [9, 1, 4] and map_in_order(str, []) == []

    def fail_odd(x):
        if x % 2:
            raise ValueError(f"item {x}")
        return x

    with pytest.raises(ValueError, match="item 1"):
        map_in_order(fail_odd, [0, 1, 2, 3])
    if work_pool.MAX_WORKERS < 2:
        pytest.skip("one CPU: the pool has one thread")
    together = threading.Barrier(2, timeout=10)  # broken (an error) unless two items wait at once
    names = map_in_order(lambda _: together.wait() is not None and threading.current_thread().name, [0, 1])
    assert len(set(names)) == 2 and all(n.startswith("worldserve-media") for n in names)


def _data_url(seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 40, 3), np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _request(*urls: str) -> ChatCompletionRequest:
    first = [{"type": "image_url", "image_url": {"url": u}} for u in urls[:2]] + [
        {"type": "text", "text": "Hi"}
    ]
    later = [{"type": "image_url", "image_url": {"url": u}} for u in urls[2:]]
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": first}, {"role": "assistant", "content": "ok"},
        {"role": "user", "content": later}]})  # fmt: skip


def test_a_requests_images_decoded_at_once_are_the_images_one_by_one(monkeypatch):
    urls = [_data_url(s) for s in range(3)]
    pooled = build_params(_request(*urls), None)
    monkeypatch.setattr(work_pool, "MAX_WORKERS", 1)  # the plain loop
    alone = build_params(_request(*urls), None)
    for a, b in zip(pooled.messages, alone.messages, strict=True):
        assert a.role == b.role and type(a.content) is type(b.content)
        if isinstance(a.content, tuple):
            assert [p.type for p in a.content] == [p.type for p in b.content]
            assert all(np.array_equal(p.image, q.image) for p, q in zip(a.content, b.content, strict=True)
                       if p.type == "image")  # fmt: skip
    assert [p.type for p in pooled.messages[0].content] == ["image", "image", "text"]
    bad = "data:image/png;base64," + base64.b64encode(b"not an image").decode()
    with pytest.raises(ParamError) as err:
        build_params(_request(urls[0], bad, bad), None)
    assert err.value.param == "messages[0].content[1].image_url"
