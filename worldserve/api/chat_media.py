"""The media parts of a chat request (image_url / video_url): fetched, loaded, checked and decoded.

`prefetch_media(body, fetcher, limits)` (async, on the event loop) first checks the request's media counts
(`--limit-mm-per-prompt`) and then downloads every http(s) URL part at once on the fetcher's own thread
pool (api/media_urls.py: vLLM's VLLM_IMAGE_FETCH_TIMEOUT / VLLM_VIDEO_FETCH_TIMEOUT, one upload limit
shared by the request's downloads), so slow remote servers hold neither the event loop nor the threads the
rest of the API works on. `part(...)` (blocking, in a worker thread) turns one content part into a
`ChatPart`: its bytes from the prefetched downloads, a base64 `data:` URL or a `file://` path under
--allowed-local-media-path (a regular file of at most 1 GiB: never a FIFO or a device); images decoded and
checked against Qwen3-VL's `smart_resize` precondition (aspect ratio at most 200; any size down to 1x1 is
scaled up to the processor's minimum), videos decoded with PyAV and sampled as Qwen3-VL's processor samples
them, each kept frame resized as it is decoded, their decode work bounded a request (media/decode_budget.py). The same bytes again (a conversation's next turn) take the
decoded image / video from the Reasoner's processor cache (media/processor_cache.py) when given one.
Errors name the part (`messages[i].content[j].image_url`).
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from worldserve.api.chat_messages import ContentPart, MediaURL
from worldserve.api.chat_protocol import ChatCompletionRequest
from worldserve.api.data_urls import data_url_bytes, frame_list_bytes
from worldserve.api.media_io_options import RGBA_BACKGROUND
from worldserve.api.media_urls import DownloadBudget, MediaFetcher, is_http_url
from worldserve.chat_params import ChatPart, VideoSampling
from worldserve.media.decode_budget import DecodeBudget
from worldserve.media.image import decode_image, image_size, max_pixels
from worldserve.media.processor_cache import ProcessorCache, content_key
from worldserve.media.video_input import decode_chat_frames, decode_chat_video
from worldserve.params import ParamError

if TYPE_CHECKING:
    import numpy as np


def media_parts(body: ChatCompletionRequest) -> Iterator[tuple[str, str, str]]:
    """(path, kind, url) of every image_url / video_url part, path as `messages[i].content[j].<type>`."""
    for i, msg in enumerate(body.messages):
        if msg.content is None or isinstance(msg.content, str):
            continue
        for j, p in enumerate(msg.content):
            if p.type in ("image_url", "video_url"):
                path = f"messages[{i}].content[{j}].{p.type}"
                kind = p.type.removesuffix("_url")
                yield path, kind, _url(getattr(p, p.type), kind, path)


async def prefetch_media(
    body: ChatCompletionRequest, fetcher: MediaFetcher | None, limits: Mapping[str, int] | None = None
) -> dict[str, bytes]:
    """The request's http(s) media, path -> bytes, downloaded concurrently within one budget (no fetcher:
    none; `part` then refuses such URLs); the media counts are checked first, before any download. The first
    download to fail fails the request at once (as vLLM's gather does) and stops the others, as does the
    request's cancellation (its client left)."""
    check_media_counts(body, limits or {})
    wanted = [(path, kind, url) for path, kind, url in media_parts(body) if is_http_url(url)]
    if fetcher is None or not wanted:
        return {}
    budget = DownloadBudget(fetcher.max_bytes)
    tasks = [
        asyncio.ensure_future(
            fetcher.fetch(url, param=path, kind=kind, timeout_s=fetcher.chat_timeout_s(kind), budget=budget)
        )  # fmt: skip
        for path, kind, url in wanted
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:  # (of the failures done together, the first in the request's order)
            if task.done() and (exc := task.exception()) is not None:
                raise exc
        return {path: task.result() for (path, _, _), task in zip(wanted, tasks, strict=True)}
    finally:
        if not all(task.done() for task in tasks):
            budget.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def load_media_url(
    url: str, allowed_local_path: str | None, kind: str = "image", *, param: str = "messages",
    fetched: Mapping[str, bytes] | None = None,
) -> bytes:  # fmt: skip
    """The bytes behind an image / video URL (data:, file:// under `allowed_local_path`, or an http(s) URL's
    download in `fetched`, keyed by `param`: prefetch_media); raises ParamError(param)."""
    try:
        scheme = urlparse(url).scheme.lower()
    except ValueError as exc:  # (urlparse's own refusals: "Invalid IPv6 URL")
        raise ParamError(param, f"Invalid {kind} URL: {exc}.") from None
    if scheme == "data":
        return data_url_bytes(url, param=param, bad_payload=f"Invalid base64 data in the {kind} data URL.")
    if scheme == "file":
        if not allowed_local_path:
            raise ParamError(param, "Cannot load local files without `--allowed-local-media-path`.")
        parts = urlparse(url)
        if parts.netloc not in ("", "localhost"):  # (file://host/path is a file on that host: not ours)
            raise ParamError(param, f"A file:// URL names a local file: its host must be empty or "
                             f"localhost, not {parts.netloc[:100]!r} (file:///path).")  # fmt: skip
        given = unquote(parts.path)  # messages name it, never what its symlinks resolve to
        if not given:
            raise ParamError(param, "The file:// URL names no file (file:///path/to/media).")
        if "\0" in given:
            raise ParamError(param, "The file path contains a NUL character.")
        try:
            path = Path(given).resolve()
        except (
            RuntimeError,
            OSError,
        ) as exc:  # (a symlink loop: RuntimeError before Python 3.13, then OSError)
            raise ParamError(param, f"The file path {given} cannot be resolved ({exc}).") from None
        root = Path(allowed_local_path).resolve()
        if not path.is_relative_to(root):
            raise ParamError(
                param, f"The file path {given} must be a subpath of `--allowed-local-media-path {root}`."
            )
        return _read_local_file(path, given, param)
    if scheme in ("http", "https") and fetched is not None and param in fetched:
        return fetched[param]
    if scheme in ("http", "https"):
        raise ParamError(param, "http(s) media are not downloaded here; send a base64 data URL")
    raise ParamError(param, f"Unsupported {kind} URL scheme {scheme!r}: use a base64 data URL, an http(s) URL "
                     "or a file:// URL (under --allowed-local-media-path)")  # fmt: skip


MAX_LOCAL_FILE_BYTES = 1 << 30
"""The largest file:// media read (1 GiB): it is read whole into memory to be decoded."""


def _read_local_file(path: Path, given: str, param: str) -> bytes:
    """The bytes of the regular file at `path` (resolved; `given`: as the request named it); ParamError(param)
    for anything else (a directory; a FIFO, which could block its thread for ever; /dev/zero, which never
    ends) and for a file over MAX_LOCAL_FILE_BYTES. Opened without blocking, and without following its last
    component if a symlink was swapped in for it since it was resolved."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        raise ParamError(param, f"Cannot read {given}: {exc.strerror}") from None
    try:  # (the descriptor is closed on every way out: a directory's once leaked it, and was a 500)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ParamError(param, f"Cannot read {given}: not a regular file.")
        if info.st_size > MAX_LOCAL_FILE_BYTES:
            raise ParamError(param, f"Cannot read {given}: larger than {MAX_LOCAL_FILE_BYTES >> 20} MiB.")
        with open(fd, "rb", closefd=False) as file:
            data = file.read(MAX_LOCAL_FILE_BYTES + 1)  # (a file may grow meanwhile, or not know its size)
    except OSError as exc:
        raise ParamError(param, f"Cannot read {given}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_LOCAL_FILE_BYTES:
        raise ParamError(param, f"Cannot read {given}: larger than {MAX_LOCAL_FILE_BYTES >> 20} MiB.")
    return data


def _url(ref: MediaURL | str | None, kind: str, path: str) -> str:
    url = ref if isinstance(ref, str) else ref.url if ref is not None else ""
    if not url:
        raise ParamError(path, f"{'an' if kind == 'image' else 'a'} {kind}_url part needs {kind}_url.url")
    return url


def check_media_counts(body: ChatCompletionRequest, limits: Mapping[str, int]) -> None:
    """ParamError("messages") when the request carries more images / videos than `limits` allow."""
    for kind in ("image", "video"):
        count = sum(
            1 for m in body.messages if not isinstance(m.content, str | None) for p in m.content
            if p.type == f"{kind}_url"
        )  # fmt: skip
        limit = limits.get(kind)
        if limit is not None and count > limit:
            raise ParamError("messages", f"At most {limit} {kind}(s) may be provided in one request "
                             f"(--limit-mm-per-prompt); this one has {count}.")  # fmt: skip


MAX_ASPECT_RATIO = 200
"""Qwen2-VL / Qwen3-VL `smart_resize` refuses a longer side over 200 times the shorter one."""


MAX_REQUEST_PIXELS = 3 * max_pixels()
"""Pixels a request's images may decode to in all (~268 M, 0.8 GB of RGB: three of the largest image decoded
at all); a 10 kB one-bit PNG decodes to 9400 x 9400, so without a cap a request of a few of them took GBs."""


class ImageBudget:
    """What a request's images may take, charged from each image's size before it is decoded: the context's
    tokens (`max_model_len`; None: not counted, /tokenize) and MAX_REQUEST_PIXELS decoded pixels. A request
    past either is refused before the pixels are decoded (a dozen 9000x9000 PNGs, 4 MB of JSON, decoded to
    6.7 GB before the context check refused them; a low `mm_processor_kwargs` max_pixels lowers the tokens,
    not the decode). Thread-safe: a request's images load at once (media/work_pool.py)."""

    def __init__(
        self, max_model_len: int | None = None, tokens: Callable[[int, int], int] | None = None
    ) -> None:
        self.max_model_len, self.tokens = max_model_len, tokens  # tokens(height, width)
        self.max_request_pixels = MAX_REQUEST_PIXELS
        self.used = self.pixels = 0
        self._lock = threading.Lock()

    def charge(self, size: tuple[int, int] | None, path: str, *, decoded: bool) -> None:
        """Count an image of `size` (height, width; None: unknown, counted when decoded), its pixels when it is
        to be `decoded` (not found decoded in the cache); ParamError("messages") once the images counted so
        far exceed the context or the pixels."""
        if size is None:
            return
        with self._lock:
            self.pixels += size[0] * size[1] if decoded else 0
            pixels = self.pixels
        if pixels > self.max_request_pixels:
            raise ParamError("messages", f"The request's images decode to {pixels:,} pixels or more (counted as "
                             f"they load, the last {path}), above the limit of {self.max_request_pixels:,} "
                             "a request. Please send fewer or smaller images.")  # fmt: skip
        if self.tokens is None or self.max_model_len is None:
            return
        try:  # (the smaller of the two orientations: an EXIF rotation may turn it)
            tokens = min(self.tokens(*size), self.tokens(*size[::-1]))
        except ValueError:  # an aspect ratio the processor refuses: check_image names it once decoded
            return
        with self._lock:
            self.used += tokens
            used = self.used
        if used > self.max_model_len:
            raise ParamError("messages", f"This model's maximum context length is {self.max_model_len} tokens. "
                             f"However, its images alone take {used} tokens or more (counted as they load, the "
                             f"last {path}). Please send fewer or "
                             "smaller images, or a lower mm_processor_kwargs max_pixels.")  # fmt: skip


def check_image(image: np.ndarray, path: str) -> None:
    """A decoded image the Qwen3-VL processor can resize (any side >= 1 pixel); ParamError(path) otherwise."""
    h, w = image.shape[:2]
    if max(h, w) > MAX_ASPECT_RATIO * min(h, w):
        raise ParamError(
            path, f"Invalid {path}: the image is {w}x{h} pixels: its aspect ratio (longer side / shorter side) "
            "must be at most "
            f"{MAX_ASPECT_RATIO}, got {max(h, w) / min(h, w):g}",
        )  # fmt: skip


def part(
    part: ContentPart,
    path: str,
    allowed_local_path: str | None,
    sampling: VideoSampling,
    fetched: Mapping[str, bytes] | None = None,
    cache: ProcessorCache | None = None,
    image_budget: ImageBudget | None = None,
    background: tuple[int, int, int] = RGBA_BACKGROUND,
    video_budget: DecodeBudget | None = None,
) -> ChatPart:
    """One content part, its media loaded and decoded (an image's transparent pixels over `background`; a
    video's decode work counted against `video_budget`, none: no limit; the same bytes, and for a video the
    same sampling, found in `cache` are not decoded again, at no cost; without a cache that keeps anything, no
    key is hashed); errors name `path` (messages[i].content[j])."""
    if part.type == "text":
        if part.text is None:  # (OpenAI's 400; it had been rendered as empty text)
            raise ParamError(f"{path}.text", f"Missing required parameter: '{path}.text'.")
        return ChatPart(type="text", text=part.text)
    if part.type == "image_url":
        path += ".image_url"
        data = load_media_url(
            _url(part.image_url, "image", path),
            allowed_local_path,
            param=path,
            fetched=fetched,
        )
        return _image_part(data, path, cache, image_budget, background)
    if part.type == "video_url":
        path += ".video_url"
        return _video_part(_url(part.video_url, "video", path), path, allowed_local_path, sampling, fetched,
                           cache, video_budget)  # fmt: skip
    raise ParamError(f"{path}.type", f"content parts of type {part.type!r} are not supported")


def _image_part(
    data: bytes, path: str, cache: ProcessorCache | None, budget: ImageBudget | None,
    background: tuple[int, int, int],
) -> ChatPart:  # fmt: skip
    """An image part from its bytes: charged to `budget` by its size, then decoded over `background` and
    checked, unless `cache` has it (then kept there once decoded); errors name `path` (...image_url)."""
    keyed = cache is not None and cache.enabled
    key = content_key(data) if keyed else None
    if key is not None and background != RGBA_BACKGROUND:  # other pixels from the same bytes: another key
        key = content_key(key + bytes(background))
    image = cache.get(("image", key)) if cache is not None and key is not None else None
    if budget is not None:
        size = image.shape[:2] if image is not None else image_size(data)
        budget.charge(size, path, decoded=image is None)
    if image is None:
        image = decode_image(data, param=path, rgba_background=background)
        check_image(image, path)
        if cache is not None and key is not None:
            image.flags.writeable = False  # shared by every request that finds it: a write would raise
            cache.put(("image", key), image, image.nbytes)
    return ChatPart(type="image", image=image, media_key=key)


def _video_part(
    url: str, path: str, allowed_local_path: str | None, sampling: VideoSampling,
    fetched: Mapping[str, bytes] | None, cache: ProcessorCache | None, budget: DecodeBudget | None,
) -> ChatPart:  # fmt: skip
    """A video part from its URL (vLLM's data:video/jpeg frame list, or a video file's bytes), decoded and
    sampled as `sampling` says with its work counted against `budget`, unless `cache` has it with that
    sampling (then kept there once decoded); errors name `path` (...video_url)."""
    keyed = cache is not None and cache.enabled
    frames = frame_list_bytes(url, param=path)  # vLLM's data:video/jpeg of separate frames, or None
    data = url.encode() if frames is not None else load_media_url(
        url, allowed_local_path, "video", param=path, fetched=fetched
    )  # fmt: skip
    video_key = ("video", content_key(data), sampling) if keyed else None
    if cache is not None and video_key is not None and (video := cache.get(video_key)) is not None:
        return ChatPart(type="video", video=video)
    try:
        if frames is not None:
            video = decode_chat_frames(frames, sampling, param=path, budget=budget)
        else:
            video = decode_chat_video(data, sampling, param=path, budget=budget)
    except ParamError as exc:
        if exc.param == path:
            raise
        raise ParamError(path, exc.message) from None  # the frame-size check names no part
    if cache is not None and video_key is not None:
        cache.put(video_key, video, video.frames.nbytes)
    return ChatPart(type="video", video=video)
