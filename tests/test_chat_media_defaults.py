"""Chat media options over the server's `--mm-processor-kwargs` / `--media-io-kwargs` on real uvicorns (tiny
Reasoner): a request valid on its own is never a 400 for the server's defaults (its video sampling, its
per-modality key and its pixel bounds replace the server's, whose contradicting bound steps aside);
`mm_processor_kwargs.do_sample_frames` (vLLM takes it for Qwen3-VL: true is the default sampling, false the
clip's frames as decoded, as transformers' video processor takes them then); and an image sent as a chat
video that FFmpeg cannot read answered with the image's own error, as an image part is.
"""

from __future__ import annotations

import base64
import contextlib
import io
import struct
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image
from serving_helpers import serve_reasoner

from worldserve.api.chat_options import MediaDefaults
from worldserve.media.video import encode_mp4

MODEL = "test-model"
TEXT = {"type": "text", "text": "hi"}
SERVERS = {
    "plain": MediaDefaults(),
    "fps": MediaDefaults({}, {"fps": 1}),
    "pixels": MediaDefaults({}, {"max_pixels": 1000}),
    "recipe": MediaDefaults({"video": {"num_frames": -1}}, {}),
}
"""Each server's --media-io-kwargs / --mm-processor-kwargs (the reviewer's two, and the Reasoner recipe's)."""


@pytest.fixture(scope="module")
def servers(reasoner, tmp_path_factory):
    with contextlib.ExitStack() as stack:
        yield {
            key: stack.enter_context(serve_reasoner(
                reasoner, tmp_path_factory.mktemp(f"media-{key}"), model=MODEL, name=f"media-{key}-uvicorn",
                media_defaults=defaults,
            ))
            for key, defaults in SERVERS.items()
        }  # fmt: skip


def _chat(url: str, content: list, mm: dict | None = None, io_kwargs: dict | None = None) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": content}],
            "mm_processor_kwargs": mm, "media_io_kwargs": io_kwargs}  # fmt: skip
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)


def _tokens(url: str, content: list, mm: dict | None = None, io_kwargs: dict | None = None) -> int:
    r = _chat(url, content, mm, io_kwargs)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def _error(url: str, content: list, mm: dict | None = None) -> dict:
    r = _chat(url, content, mm)
    assert r.status_code == 400, r.text
    return r.json()["error"]


def _url(kind: str, data: bytes, mime: str) -> dict:
    return {"type": kind, kind: {"url": f"data:{mime};base64," + base64.b64encode(data).decode()}}


def _image(h: int, w: int) -> list:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return [_url("image_url", buf.getvalue(), "image/png"), TEXT]


def _clip(frames: int, h: int = 64, w: int = 96) -> bytes:
    """An MP4 of `frames` noise frames at 24 fps."""
    return encode_mp4(np.random.default_rng(1).integers(0, 256, (frames, h, w, 3), dtype=np.uint8), 24.0)


def _video(frames: int) -> list:
    return [_url("video_url", _clip(frames), "video/mp4"), TEXT]


def test_a_requests_video_sampling_replaces_the_servers(servers):
    """--mm-processor-kwargs '{"fps": 1}': a request's num_frames (flat or in videos_kwargs) or fps samples
    the clip as on a server without it (it was a 400, "fps and num_frames are mutually exclusive"); a request
    that sets none gets the server's fps."""
    video = _video(24)  # (1 s: fps 1 samples Qwen3-VL's least, 4 frames; num_frames 8, 8)
    for own in (
        {"num_frames": 8},
        {"videos_kwargs": {"num_frames": 8}},
        {"fps": 8},
        {"videos_kwargs": {"fps": 8}},
    ):
        assert _tokens(servers["fps"], video, own) == _tokens(servers["plain"], video, own), own
    assert _tokens(servers["fps"], video) == _tokens(servers["plain"], video, {"fps": 1})
    assert _tokens(servers["fps"], video, {"num_frames": 8}) > _tokens(servers["fps"], video)
    # (the request's own contradiction is still its 400)
    err = _error(servers["fps"], video, {"num_frames": 8, "fps": 2})
    assert err["param"] == "mm_processor_kwargs" and "mutually exclusive" in err["message"], err


def test_a_requests_per_modality_key_replaces_the_servers_flat_one(servers):
    """--mm-processor-kwargs '{"max_pixels": 1000}' with a request's images_kwargs.max_pixels: the request's
    (it was a 400, "sets max_pixels twice (flat and per modality)")."""
    image = _image(256, 256)  # (64 tokens by default; 1 under max_pixels 1000)
    own = {"images_kwargs": {"max_pixels": 16777216}}
    assert _tokens(servers["pixels"], image, own) == _tokens(servers["plain"], image, own)
    assert _tokens(servers["pixels"], image, own) > _tokens(servers["pixels"], image)
    assert _tokens(servers["pixels"], image) == _tokens(servers["plain"], image, {"max_pixels": 1000})


@pytest.mark.parametrize("own", [{"min_pixels": 5000}, {"images_kwargs": {"min_pixels": 5000}},
                                 {"size": {"shortest_edge": 5000}}])  # fmt: skip
def test_a_requests_min_pixels_above_the_servers_max_pixels_sets_its_floor(servers, own):
    """--mm-processor-kwargs '{"max_pixels": 1000}' with a request's min_pixels 5000 (it was a 400, "min
    pixels 5000 > max pixels 1000", which no request had sent): the server's bound on the other side of the
    request's steps aside (the model's own max applies); one on its side stays; the request's own pair is
    checked as before."""
    image = _image(256, 256)
    assert _tokens(servers["pixels"], image, own) == _tokens(servers["plain"], image, {"min_pixels": 5000})
    kept = _tokens(servers["pixels"], image, {"min_pixels": 500})
    assert kept == _tokens(servers["plain"], image, {"min_pixels": 500, "max_pixels": 1000})
    assert kept < _tokens(servers["plain"], image, {"min_pixels": 500})
    err = _error(servers["pixels"], image, {"min_pixels": 5000, "max_pixels": 1000})
    assert err["param"] == "mm_processor_kwargs" and "min pixels 5000 > max pixels 1000" in err["message"], (
        err
    )


def test_the_servers_other_bound_steps_aside_both_ways():
    """Without a model: a request's max_pixels below the server's min_pixels takes the server's min away too,
    and its size bounds replace the server's min_pixels / max_pixels of the same kind."""
    d = MediaDefaults({}, {"min_pixels": 5000, "max_pixels": 9000})
    assert d.under(None, {"max_pixels": 1000})[1] == {"images_kwargs": {"size": {"longest_edge": 1000}}}
    assert d.under(None, {"images_kwargs": {"size": {"shortest_edge": 6000}}})[1]["images_kwargs"] == {
        "size": {"shortest_edge": 6000, "longest_edge": 9000}
    }


def test_media_defaults_merge_as_vllm_merges():
    """media_io per modality; mm_processor routed to each modality, then key by key; a request's video
    sampling in one dict sets it alone."""
    d = MediaDefaults(
        {"video": {"fps": 1.0}, "image": {"rgba_background_color": [0, 0, 0]}}, {"max_pixels": 9}
    )
    assert d.under(None, None) == ({"video": {"fps": 1.0}, "image": {"rgba_background_color": [0, 0, 0]}},
                                   {"images_kwargs": {"size": {"longest_edge": 9}}})  # fmt: skip
    io_kwargs, mm = d.under({"video": {"num_frames": 8}}, {"max_pixels": 100, "min_pixels": 4})
    assert io_kwargs["video"] == {"fps": 1.0, "num_frames": 8}
    assert mm == {"images_kwargs": {"size": {"shortest_edge": 4, "longest_edge": 100}}}
    io_kwargs, mm = d.under(None, {"videos_kwargs": {"num_frames": 8}})
    assert io_kwargs["video"] == {} and mm["videos_kwargs"] == {"num_frames": 8}
    assert MediaDefaults({}, {"fps": 1}).under({"video": {"fps": 3}}, None)[1] is None  # (none left)
    assert MediaDefaults().under(None, {}) == (None, {})


def test_do_sample_frames_true_is_the_default_and_false_takes_every_frame(servers):
    """{"fps": 8, "do_sample_frames": true} (what clients send vLLM) samples as {"fps": 8}; false takes the
    clip's frames as decoded, all 9 (Qwen3-VL's 2 fps takes 4), as transformers' video processor does
    (`sample_frames` skipped): what num_frames 9 takes. The server's fps default steps aside for it; the
    loader's sampling (media_io_kwargs.video, vLLM's) stands, the processor not sampling again."""
    plain, video = servers["plain"], _video(9)
    assert _tokens(plain, video, {"fps": 8, "do_sample_frames": True}) == _tokens(plain, video, {"fps": 8})
    assert _tokens(plain, video, {"do_sample_frames": True}) == _tokens(plain, video)
    every = _tokens(plain, video, {"do_sample_frames": False})
    assert every == _tokens(plain, video, {"num_frames": 9}) > _tokens(plain, video)
    assert _tokens(servers["fps"], video, {"videos_kwargs": {"do_sample_frames": False}}) == every
    assert _tokens(servers["recipe"], video, {"do_sample_frames": False}) == every
    loader = {"video": {"num_frames": 6}}
    assert _tokens(plain, video, {"do_sample_frames": False}, loader) == _tokens(plain, video, None, loader)


@pytest.mark.parametrize(
    ("mm", "param", "needle"),
    [
        ({"do_sample_frames": False, "fps": 2}, "mm_processor_kwargs", "do_sample_frames=false takes the clip's"),
        ({"videos_kwargs": {"do_sample_frames": False, "num_frames": 4}}, "mm_processor_kwargs", "no fps"),
        ({"do_sample_frames": "no"}, "mm_processor_kwargs.do_sample_frames", "true or false"),
        ({"images_kwargs": {"do_sample_frames": True}}, "mm_processor_kwargs.images_kwargs.do_sample_frames",
         "not supported"),
    ],
)  # fmt: skip
def test_bad_do_sample_frames_are_a_400_naming_the_key(servers, mm, param, needle):
    err = _error(servers["plain"], _video(9), mm)
    assert err["param"] == param and needle in err["message"], err


def test_every_frame_past_max_frames():
    """do_sample_frames=false takes every frame of a clip longer than Qwen3-VL's max_frames (768, which bounds
    sampling only), in order, as num_frames of the clip's length picks them."""
    from worldserve.api.media_io_options import video_sampling
    from worldserve.chat_params import VideoSampling
    from worldserve.media.video_input import decode_chat_video

    sampling = video_sampling(None, {"do_sample_frames": False})
    assert sampling.indices(5, 30.0) == [0, 1, 2, 3, 4]
    data = _clip(800, 16, 16)
    video = decode_chat_video(data, sampling)
    assert video.indices == tuple(range(800)) and len(video.frames) == 800
    same = decode_chat_video(_clip(9), VideoSampling(fps=None, num_frames=9))
    every = decode_chat_video(_clip(9), sampling)
    assert every.indices == same.indices and np.array_equal(every.frames, same.frames)


def _png_claiming(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header says `width` x `height` (its IHDR rewritten, CRC fixed)."""
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    ihdr = data[12:29]  # b"IHDR" + its 13 bytes
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29], data[29:33] = ihdr, struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return bytes(data)


@pytest.mark.parametrize("side", [20000, 10000])
def test_a_too_large_image_sent_as_a_video_gets_the_images_error(servers, side):
    """A 20000x20000 PNG as a chat video_url (FFmpeg's PNG decoder refuses that size: it was "not a valid
    video") gets the image_url's error, naming the part; a 10000x10000 one (FFmpeg reads its size) the same
    words (as an image_url, its tokens are past the tiny context first)."""
    from worldserve.media.image import too_large

    data = _png_claiming(side, side)
    as_video = _error(servers["plain"], [_url("video_url", data, "video/mp4"), TEXT])
    path = "messages[0].content[0].video_url"
    assert as_video["param"] == path and as_video["message"] == too_large(path, side * side).message, as_video
    if side == 20000:
        as_image = _error(servers["plain"], [_url("image_url", data, "image/png"), TEXT])
        assert as_video["message"] == as_image["message"].replace("image_url", "video_url"), as_image
