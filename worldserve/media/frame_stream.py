"""Video frames that arrive in chunks, so an MP4 encode runs while the VAE is still decoding.

The Wan2.2 decoder is causal in time and makes its pixels chunk by chunk (frame 0, then 4 frames per
latent frame, 2 latent frames a chunk by default), so the first frames are final long before the last: at 720p x 189 frames the decode takes
~3.9 s on an H200 and the H.264 + AAC mux ~1.3 s, which used to start only when the decode had ended.

- `FrameStream`: uint8 frames (F, H, W, 3) whose size is known up front and whose pixels come as chunks
  (n_i, H, W, 3), each anything `np.asarray` takes. Iterating checks every chunk and the total count, so a
  consumer (media.video `encode_mp4`) never muxes a short or malformed video, and closes the chunks' source
  when it stops early (a decode generator then leaves its locks at once).
- `FramePipe` / `read_beside`: hand a stream's chunks from the thread that makes them (the engine, decoding
  under the model lock) to one that reads them (an encoder in the engine's CPU pool). Unbounded, so the decoding
  thread never waits for the encoder (at most the whole video is held, as when it was handed over in one
  piece); a reader that stops early abandons the pipe, later chunks are dropped and `read_beside` stops
  making them; a decode that fails `fail`s it and the reader gets `FramesLost` next (chunks it has not taken
  are dropped), as it does when another thread sets `read_beside`'s `stop` (an abort: the decode stops at its
  next chunk).
- `lower_thread_priority`: the muxing threads (the engine's encode pool, media.video's conversion pool) run
  at nice 10, so the thread feeding the GPU wins the CPUs when they are all busy.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Executor, Future
from typing import TypeVar

import numpy as np

ENCODER_NICENESS = 10
"""The CPU priority (nice value) of the threads that mux MP4s beside the GPU work (`lower_thread_priority`)."""


def lower_thread_priority() -> None:
    """Give the calling thread (and the threads it starts, as x264's: Linux inherits a thread's nice value)
    nice ENCODER_NICENESS, unless already lower. MP4 muxes run beside the engine thread that launches the
    GPU's kernels (a job's mux overlaps its own VAE decode and the next request's steps); when every CPU is
    busy, the launches should win. An idle machine runs the same. A no-op where threads have no own nice."""
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), ENCODER_NICENESS))


class FramesLost(Exception):
    """The frames' producer failed before the last chunk (its own error is `__cause__`)."""


class FrameStream:
    """`num_frames` uint8 frames of `height` x `width` x 3, arriving as chunks (n_i, H, W, 3).

    Iterate it once (chunks as ndarrays, each checked); `close()` tells the producer nobody reads any
    more (`on_close`, e.g. `FramePipe.abandon`)."""

    def __init__(
        self,
        num_frames: int,
        height: int,
        width: int,
        chunks: Iterable,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        if num_frames < 1 or height < 1 or width < 1:
            raise ValueError(f"a frame stream needs F, H, W >= 1, got {num_frames}, {height}, {width}")
        self.num_frames, self.height, self.width = num_frames, height, width
        self.chunks = chunks
        """The chunks' source (iterated once, by `__iter__`)."""
        self._on_close = on_close

    @classmethod
    def of(cls, frames: np.ndarray) -> FrameStream:
        """All frames (F, H, W, 3) at once, as one chunk."""
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3 or frames.shape[0] < 1:
            raise ValueError(f"frames must be uint8 (F>=1, H, W, 3), got {frames.dtype} {frames.shape}")
        return cls(frames.shape[0], frames.shape[1], frames.shape[2], [frames])

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.num_frames, self.height, self.width, 3)

    def __iter__(self) -> Generator[np.ndarray, None, None]:
        source = iter(self.chunks)
        try:
            yield from self._checked(source)
        finally:  # stopped early (a bad chunk, a reader that left): the producer's `with` blocks exit now
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def _checked(self, source: Iterator) -> Iterator[np.ndarray]:
        seen = 0
        for chunk in source:
            array = np.asarray(chunk)
            if array.dtype != np.uint8 or array.ndim != 4 or array.shape[1:] != self.shape[1:]:
                raise ValueError(f"a chunk of {self.shape} frames must be uint8 (n, {self.height}, "
                                 f"{self.width}, 3), got {array.dtype} {array.shape}")  # fmt: skip
            seen += array.shape[0]
            if seen > self.num_frames:
                raise ValueError(f"the chunks hold more than the stream's {self.num_frames} frames")
            yield array
        if seen != self.num_frames:
            raise ValueError(f"the chunks ended after {seen} of the stream's {self.num_frames} frames")

    def to_array(self) -> np.ndarray:
        """All frames (F, H, W, 3), read to the end."""
        return np.concatenate(list(self))

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()


_END = object()
T = TypeVar("T")


class FramePipe:
    """One producer thread `put`s chunks and then `close`s (or `fail`s); one reader iterates `reader()`."""

    def __init__(self, num_frames: int, height: int, width: int) -> None:
        self._shape = (num_frames, height, width)
        self._cv = threading.Condition()
        self._queue: deque = deque()
        self._abandoned = False

    @classmethod
    def like(cls, stream: FrameStream) -> FramePipe:
        return cls(stream.num_frames, stream.height, stream.width)

    def put(self, chunk: object) -> None:
        """The next chunk of frames (uint8 (n, H, W, 3)), for the reader."""
        with self._cv:
            if not self._abandoned:
                self._queue.append(chunk)
                self._cv.notify()

    def close(self) -> None:
        """The last chunk was put."""
        self.put(_END)

    def fail(self, exc: BaseException) -> None:
        """The producer failed (or was stopped): the reader gets FramesLost (caused by `exc`) next; chunks it
        has not taken yet are dropped (the video is lost: muxing them would only cost CPU and memory)."""
        lost = FramesLost(f"the video's frames were lost: {exc}")
        lost.__cause__ = exc
        with self._cv:
            if not self._abandoned:
                self._queue.clear()
                self._queue.append(lost)
                self._cv.notify()

    def abandon(self) -> None:
        """The reader stopped: drop what is queued and whatever comes (a reader still waiting returns)."""
        with self._cv:
            self._abandoned = True
            self._queue.clear()
            self._cv.notify_all()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def reader(self) -> FrameStream:
        """The reading side, a FrameStream (its `close()` abandons the pipe)."""
        return FrameStream(*self._shape, self._chunks(), on_close=self.abandon)

    def _chunks(self) -> Iterator:
        while True:
            with self._cv:
                while not self._queue and not self._abandoned:
                    self._cv.wait()
                if self._abandoned:
                    return
                item = self._queue.popleft()
            if item is _END:
                return
            if isinstance(item, FramesLost):
                try:
                    raise item
                finally:  # (the traceback holds this frame: without the del, a cycle keeps the producer's
                    del item  # frames, e.g. a failed decode's GPU tensors, until the cycle collector runs)
            yield item


def _read_then_close(reader: Callable[[FrameStream], T], stream: FrameStream) -> T:
    """`reader(stream)`, then `stream.close()` whatever happened: a reader that failed or returned early
    stops the making at once (its own generator may be kept open by the exception's traceback)."""
    try:
        return reader(stream)
    finally:
        stream.close()


class FramesCancelled(Exception):
    """The frames were no longer wanted (the request was aborted) before the last chunk was made."""


def read_beside(
    stream: FrameStream,
    reader: Callable[[FrameStream], T],
    pool: Executor,
    before_end: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> Future[T]:
    """Run `reader` in `pool` on a copy of `stream` whose chunks arrive as this thread makes them (iterating
    `stream` here: for a decode, on the thread and under the lock the decode needs). Returns the reader's
    future after the last chunk; `before_end` runs just before the reader sees the end of a whole stream. When making a chunk
    fails, the reader gets FramesLost and the error is raised here; when the reader stops early, so does
    the making (the stream's source is closed). Another thread setting `stop` ends the making after the
    chunk in hand; the reader then gets FramesLost caused by FramesCancelled, and nothing is raised here."""
    pipe = FramePipe.like(stream)
    future = pool.submit(_read_then_close, reader, pipe.reader())
    chunks = iter(stream)
    try:
        for chunk in chunks:
            if pipe.abandoned:
                break  # nobody reads any more: stop making chunks
            if stop is not None and stop.is_set():
                pipe.fail(FramesCancelled("the request was aborted while its frames were decoded"))
                break
            pipe.put(chunk)
        else:  # (every chunk made: not after a stop or an abandoned read)
            if before_end is not None:
                before_end()
    except BaseException as exc:
        pipe.fail(exc)
        raise
    finally:
        chunks.close()  # (closes the stream's source too, when it stopped early)
    pipe.close()
    return future
