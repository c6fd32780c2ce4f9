"""L0: frames in chunks (media/frame_stream.py): an MP4 muxed while its frames still arrive from another thread
is byte for byte the MP4 of the whole array; malformed, short or long streams fail the encode; a failed
producer reaches the reader as FramesLost; an abandoned pipe drops what comes; a stop set from another thread
(an abort) ends the making at the next chunk."""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from media_probe import probe_mp4

from worldserve.media.frame_stream import (
    ENCODER_NICENESS,
    FramePipe,
    FramesCancelled,
    FramesLost,
    FrameStream,
    lower_thread_priority,
    read_beside,
)
from worldserve.media.video import encode_mp4

SR = 48000


def _clip(num_frames: int = 21, height: int = 32, width: int = 48, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (num_frames, height, width, 3), dtype=np.uint8)


def _feed(
    pipe: FramePipe, chunks: list, delay: float = 0.0, error: Exception | None = None
) -> threading.Thread:
    """Put `chunks` from another thread, `delay` s apart (a decoder's pace), then close (or fail)."""

    def run():
        for chunk in chunks:
            time.sleep(delay)
            pipe.put(chunk)
        pipe.fail(error) if error is not None else pipe.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_streamed_mp4_equals_the_whole_array_mp4():
    frames = _clip()
    audio = np.random.default_rng(1).uniform(-0.5, 0.5, (2, int(21 / 8 * SR))).astype(np.float32)
    whole = encode_mp4(frames, 8.0, audio, sample_rate=SR)
    pipe = FramePipe(*frames.shape[:3])
    thread = _feed(pipe, [frames[:1], frames[1:9], frames[9:17], frames[17:]], delay=0.01)
    streamed = encode_mp4(pipe.reader(), 8.0, audio, sample_rate=SR)
    thread.join()
    assert streamed == whole
    p = probe_mp4(streamed)
    assert (p.num_frames, p.width, p.height) == (21, 48, 32)


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([_clip(5), _clip(4)], "ended after 9 of the stream's 10 frames"),
        ([_clip(6), _clip(6)], "more than the stream's 10 frames"),
        ([_clip(5), _clip(5, width=32)], "must be uint8 (n, 32, 48, 3)"),
        ([_clip(5), _clip(5).astype(np.int16)], "int16"),
    ],
)
def test_a_malformed_stream_fails_the_encode(chunks, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        encode_mp4(FrameStream(10, 32, 48, chunks), 8.0)


def test_a_failed_producer_reaches_the_reader_next():
    pipe = FramePipe(9, 32, 48)
    thread = _feed(pipe, [_clip(4)], error=RuntimeError("CUDA out of memory"))
    got = []
    with pytest.raises(FramesLost, match="CUDA out of memory") as info:
        for chunk in pipe.reader():
            got.append(chunk)
    thread.join()
    assert [c.shape[0] for c in got] in ([], [4])  # (the chunk, if the reader took it before the failure)
    assert isinstance(info.value.__cause__, RuntimeError)
    late = FramePipe(9, 32, 48)  # chunks the reader has not taken when the producer fails are dropped
    _feed(late, [_clip(4), _clip(4)], error=RuntimeError("boom")).join()
    with pytest.raises(FramesLost):
        next(iter(late.reader()))
    with pytest.raises(FramesLost):  # and the encoder fails with it, muxing nothing
        pipe2 = FramePipe(9, 32, 48)
        _feed(pipe2, [_clip(4)], error=RuntimeError("boom")).join()
        encode_mp4(pipe2.reader(), 8.0)


def test_an_abandoned_pipe_drops_what_comes():
    pipe = FramePipe(9, 32, 48)
    pipe.put(_clip(4))
    reader = pipe.reader()
    reader.close()
    pipe.put(_clip(5))
    pipe.close()
    assert not pipe._queue  # nothing held for a reader that left


def test_stream_sizes_are_checked_up_front():
    with pytest.raises(ValueError, match="F, H, W >= 1"):
        FrameStream(0, 32, 48, [])
    with pytest.raises(ValueError, match="even frame sizes"):
        encode_mp4(FrameStream(1, 31, 48, [_clip(1, 31, 48)]), 8.0)
    with pytest.raises(ValueError, match=r"frames must be uint8 \(F>=1, H, W, 3\)"):
        encode_mp4(np.zeros((0, 32, 48, 3), np.uint8), 8.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads have their own nice value on Linux")
def test_muxing_threads_run_at_a_lower_cpu_priority():
    """The engine's encode pool (and the frame conversion pool) start at nice 10, and threads they start
    inherit it (as x264's do); the calling thread keeps its own."""
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def child():
        seen["child"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def job():
        seen["pool"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        t = threading.Thread(target=child)
        t.start()
        t.join()

    with ThreadPoolExecutor(1, initializer=lower_thread_priority) as pool:
        pool.submit(job).result()
    assert seen == {"pool": max(own, ENCODER_NICENESS), "child": max(own, ENCODER_NICENESS)}
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


def test_abandoning_wakes_a_waiting_reader_and_stops_read_beside():
    """A reader closed from another thread returns at once; read_beside stops making chunks (and closes
    their source) once its reader has left."""
    pipe = FramePipe(5, 32, 48)
    reader = pipe.reader()
    got = []
    thread = threading.Thread(target=lambda: got.append(list(reader.chunks)))
    thread.start()
    time.sleep(0.05)
    reader.close()
    thread.join(2)
    assert not thread.is_alive() and got == [[]]

    made, closed = [], []

    def chunks():
        try:
            for i in range(9):
                made.append(i)
                yield _clip(1)
        finally:
            closed.append(True)

    def leaves_early(frames):
        next(iter(frames))
        frames.close()
        time.sleep(0.05)  # the maker notices on its next chunk

    def slow():
        for chunk in chunks():
            time.sleep(0.02)
            yield chunk

    with ThreadPoolExecutor(1) as pool:
        read_beside(FrameStream(9, 32, 48, slow()), leaves_early, pool).result()
    assert len(made) < 9 and closed == [True]

    made.clear(), closed.clear()

    def fails(frames):  # an encoder failing mid-stream, without closing what it read (the generate CLI's)
        next(iter(frames))
        time.sleep(0.05)
        raise RuntimeError("x264 failed")

    with ThreadPoolExecutor(1) as pool:
        future = read_beside(FrameStream(9, 32, 48, slow()), fails, pool)
        with pytest.raises(RuntimeError, match="x264 failed"):
            future.result()
    assert len(made) < 9 and closed == [True], "the making stopped once its reader had failed"


def test_a_stop_from_another_thread_ends_the_making_and_the_reader_learns_why():
    """read_beside's `stop` (set by an abort, from another thread): no chunk is made after the one in hand,
    their source is closed, nothing is raised on the making thread, and the reader gets FramesLost caused by
    FramesCancelled next."""
    stop, made, closed, read = threading.Event(), [], [], []

    def chunks():
        try:
            for i in range(9):
                made.append(i)
                if i == 2:
                    stop.set()  # the abort lands while chunk 2 is being made
                yield _clip(1)
        finally:
            closed.append(True)

    def reader(frames):
        try:
            for chunk in frames:
                read.append(len(chunk))
        except FramesLost as exc:
            return exc

    with ThreadPoolExecutor(1) as pool:
        lost = read_beside(FrameStream(9, 32, 48, chunks()), reader, pool, stop=stop).result(5)
    assert made == [0, 1, 2] and closed == [True] and read in ([], [1], [1, 1])  # (what it took in time)
    assert isinstance(lost, FramesLost) and isinstance(lost.__cause__, FramesCancelled)
