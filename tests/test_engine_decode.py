"""The engine's decode and encode on the FakeBackend: a job's MP4 muxed while its frames decode, encoding
overlapping the next denoise, a DELETE or an abort reaching a running decode, a decode or an encoder that
fails mid-stream (its job fails, its locks and tensors are freed at once)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import numpy as np
import pytest
from serving_helpers import job_params, make_client, stub_encoder, submit_job, wait_until

from worldserve.engine.client import JobStatus
from worldserve.engine.fake_backend import FakeBackend, FakeState
from worldserve.engine.refusals import CancelledRequest
from worldserve.media.frame_stream import FrameStream


def run(coro):
    return asyncio.run(coro)


class _SlowDecode(FakeBackend):
    """Each streamed chunk takes 0.1 s to make (`made`: their sizes per request; `decoding`: set at the first
    chunk)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.made, self.decodes, self.decoding = {}, [], threading.Event()

    def decode(self, state, *, stream=False):
        self.decodes.append(state.request_id)
        result = super().decode(state, stream=stream)
        if stream:
            chunks = result.frames.chunks
            made = self.made.setdefault(state.request_id, [])
            result.frames.chunks = (
                self.decoding.set() or made.append(len(c)) or time.sleep(0.1) or c for c in chunks
            )
        return result


def test_delete_during_the_decode_stops_it_at_the_next_chunk(tmp_path, caplog):
    """DELETE (or a sync client leaving) while the VAE decodes: the decode stops after the chunk in hand, the
    mux stops, no MP4 is saved, nothing is logged as failed, and the next job runs."""
    backend, read = _SlowDecode(), []

    def encoder(frames, *args, **kw):
        for chunk in frames:
            read.append(len(chunk))
        return b"never saved"

    async def main():
        client = make_client(tmp_path, backend=backend, encoder=encoder)
        await client.start()
        victim = submit_job(client, job_params(frames=97))  # frame 0 + 6 chunks of 16: 0.7 s of decode
        await asyncio.to_thread(backend.decoding.wait, 5)
        assert client.delete(victim.id).status is JobStatus.IN_PROGRESS
        gone = await asyncio.wait_for(client.wait(victim.id), 5)
        after = await asyncio.wait_for(client.wait(submit_job(client, job_params(seed=2)).id), 10)
        await client.shutdown(5)
        return victim, gone, after

    victim, gone, after = run(main())
    assert gone is None and after.status is JobStatus.COMPLETED
    assert len(backend.made[victim.id]) <= 2, "stopped after the chunk in hand (of 7)"
    assert sum(read) < 97 and victim.id in backend.released and not backend.live
    assert not (tmp_path / "videos" / f"{victim.id}.mp4").exists()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_an_abort_during_the_last_step_skips_the_decode(tmp_path):
    """An abort that reaches the inbox while a request's last step runs is seen before its decode (which
    would take seconds at full size): the decode never starts, the state is released, an ephemeral
    caller gets CancelledRequest."""
    from worldserve.engine.refusals import CancelledRequest
    from worldserve.engine.request import Request

    backend, engine_ref, outcome = _SlowDecode(step_delay=0.3), [], []

    async def main():
        client = make_client(tmp_path, backend=backend)
        engine_ref.append(client.engine)
        await client.start()
        job = submit_job(client, job_params(steps=1))
        image = Request(job_id="img-1", params=job_params(steps=1, frames=1), arrival_time=time.monotonic(),
                        on_result=outcome.append)  # fmt: skip
        client.engine.add_request(image)
        await asyncio.to_thread(wait_until, lambda: backend.batch_sizes or backend.live)
        await asyncio.sleep(0.1)  # inside the 0.3 s step
        client.delete(job.id)
        client.engine.abort("img-1")
        await asyncio.to_thread(wait_until, lambda: outcome and not backend.live)
        await client.shutdown(5)

    run(main())
    assert backend.decodes == [] and not backend.live
    assert len(outcome) == 1 and isinstance(outcome[0], CancelledRequest)


def test_a_job_mp4_is_muxed_while_its_frames_decode(tmp_path):
    """The encoder reads a job's first chunks before the decode has made the last, and the MP4 is byte for
    byte the one muxed from the whole frames."""
    from worldserve.media.video import encode_mp4

    made = []

    class SlowChunks(FakeBackend):
        def decode(self, state, *, stream=False):
            result = super().decode(state, stream=stream)
            if stream:
                chunks = result.frames.chunks
                result.frames.chunks = (
                    made.append(time.monotonic()) or time.sleep(0.05) or c for c in chunks
                )
            return result

    read = []

    def encoder(frames, *args, **kw):
        read.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))  # the encode pool's nice
        chunks = frames.chunks
        frames.chunks = (read.append(time.monotonic()) or c for c in chunks)
        return encode_mp4(frames, *args, **kw)

    async def main():
        client = make_client(tmp_path, backend=SlowChunks(), encoder=encoder)
        await client.start()
        job = submit_job(client, job_params(frames=41, seed=3))
        done = await asyncio.wait_for(client.wait(job.id), 20)
        await client.shutdown(5)
        return job, done

    job, done = run(main())
    assert done.status is JobStatus.COMPLETED
    nice, read = read[0], read[1:]
    assert nice >= 10, "the mux yields the CPUs to the engine thread"
    assert len(made) == len(read) == 4, "frame 0, then 16 + 16 + 8 frames"
    assert read[0] < made[-1], "the mux started before the decode made its last chunk"
    p = job_params(frames=41, seed=3)
    whole = FakeBackend().decode(FakeState("x", 0, 1, p))
    mp4 = (tmp_path / "videos" / f"{job.id}.mp4").read_bytes()
    assert mp4 == encode_mp4(whole.frames, whole.fps, whole.audio, sample_rate=whole.sample_rate)


def test_encoding_overlaps_the_next_denoise(tmp_path):
    backend = FakeBackend(step_delay=0.02)
    events = []

    def slow_encoder(frames, fps, audio, **kw):
        events.append(("encode-start", time.monotonic()))
        time.sleep(0.6)
        events.append(("encode-end", time.monotonic()))
        return stub_encoder(frames, fps, audio, **kw)

    async def main():
        client = make_client(tmp_path, backend=backend, encoder=slow_encoder)
        await client.start()
        a, b = submit_job(client, job_params(steps=2)), submit_job(client, job_params(steps=5, seed=2))
        await asyncio.wait_for(asyncio.gather(client.wait(a.id), client.wait(b.id)), 10)
        await client.shutdown(5)
        return client.get

    run(main())
    starts = [t for name, t in events if name == "encode-start"]
    ends = [t for name, t in events if name == "encode-end"]
    # b's five steps (0.1 s) ran inside a's 0.6 s encode; serially b's encode would start after a's ended.
    assert starts[1] < ends[0]


def test_a_bad_decode_chunk_fails_the_job_and_releases_the_decoders_lock_at_once(tmp_path):
    """A decode stream that goes wrong (here one frame too many, as a count bug would) fails its job and
    closes its source right away, so the decoder's lock (VideoVAE.decode_frames holds one across chunks)
    is free even while the encode pool is busy with other work."""
    decoder_lock, pool_busy = threading.Lock(), threading.Event()

    class BadCount(FakeBackend):
        def decode(self, state, *, stream=False):
            result = super().decode(state, stream=stream)
            n = state.params.num_frames

            def chunks():
                with decoder_lock:
                    yield np.zeros((1, 64, 64, 3), np.uint8)
                    yield np.zeros((n, 64, 64, 3), np.uint8)

            result.frames = FrameStream(n, 64, 64, chunks())
            return result

    def encoder(frames, *args, **kw):
        pool_busy.wait(10)
        return b"x"

    async def main():
        client = make_client(tmp_path, backend=BadCount(), encoder=encoder, encode_workers=1)
        await client.start()
        done = await asyncio.wait_for(client.wait(submit_job(client, job_params()).id), 10)
        held = decoder_lock.locked()
        pool_busy.set()
        await client.shutdown(5)
        return done, held

    done, held = run(main())
    assert done.status is JobStatus.FAILED and "more than the stream's 5 frames" in done.error_message
    assert not held


def test_a_decode_that_fails_mid_stream_frees_what_it_held_without_the_cycle_collector(tmp_path, monkeypatch):
    """A streamed decode raising mid-way (CUDA out of memory): once the job has failed, what the decode's
    generator held (on a GPU: the decoder's cache, the pending chunk, the latents) is freed by reference
    counting. The exception's traceback holds the frames that caught it, so a frame keeping the exception
    made a cycle that kept them until the cycle collector ran; the next job could then run out of memory."""
    import gc
    import weakref

    held = []

    class Held:  # stands for the GPU tensors the decode generator's frame holds
        pass

    class FailsMidStream(FakeBackend):
        def decode(self, state, *, stream=False):
            result = super().decode(state, stream=stream)
            n = state.params.num_frames

            def chunks():
                cache = Held()
                held.append(weakref.ref(cache))
                yield np.zeros((1, 64, 64, 3), np.uint8)
                time.sleep(0.05)  # the reader is waiting for the next chunk
                raise RuntimeError("CUDA out of memory (simulated)")

            result.frames = FrameStream(n, 64, 64, chunks())
            return result

    def encoder(frames, *args, **kw):
        for _ in frames:
            pass
        return b"x"

    async def main():
        client = make_client(tmp_path, backend=FailsMidStream(), encoder=encoder)
        await client.start()
        done = await asyncio.wait_for(client.wait(submit_job(client, job_params(frames=17)).id), 10)
        await asyncio.to_thread(wait_until, lambda: held and held[0]() is None, 2.0)
        alive = held[0]() is not None
        await client.shutdown(5)
        return done, alive

    # pytest's log capture would keep the failure's record, and with it the traceback (a log handler that
    # writes the record and drops it, as the server's, does not)
    monkeypatch.setattr(logging.getLogger("worldserve.engine.endings"), "propagate", False)
    gc.disable()
    try:
        done, alive = run(main())
    finally:
        gc.enable()
    assert done.status is JobStatus.FAILED and "CUDA out of memory" in done.error_message
    assert not alive, "the failed decode's objects outlived the job (a reference cycle)"


class _Stop(BaseException):
    """Not an Exception (as SystemExit is)."""


def test_an_encoder_base_exception_still_ends_the_job(tmp_path):
    def encoder(frames, *args, **kw):
        next(iter(frames))
        raise _Stop("not an Exception")

    async def main():
        client = make_client(tmp_path, encoder=encoder)
        await client.start()
        done = await asyncio.wait_for(client.wait(submit_job(client, job_params()).id), 10)
        await client.shutdown(5)
        return done

    done = run(main())
    assert done.status is JobStatus.FAILED and "not an Exception" in done.error_message


def test_a_streamed_ephemeral_request_hands_its_frames_over_as_they_decode(tmp_path):
    """/v1/realtime/video's path: `on_frames` reads the frames in the encode pool while the engine decodes,
    then the future gets the result; one aborted during its decode stops after the chunk in hand, its
    reader gets FramesLost, the future CancelledRequest, and nothing is stored."""
    backend = _SlowDecode()
    read: dict[str, list[int]] = {}

    def on_frames(name):
        def reader(result):
            for chunk in result.frames:
                read.setdefault(name, []).append(len(chunk))

        return reader

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        _, aborted = client.jobless.stream(job_params(frames=97), "rt-aborted", on_frames("rt-aborted"))
        await asyncio.to_thread(backend.decoding.wait, 5)
        client.engine.abort("rt-aborted")
        with pytest.raises(CancelledRequest):
            await asyncio.wait_for(aborted, 5)
        request, done = client.jobless.stream(job_params(frames=33, seed=2), "rt-done", on_frames("rt-done"))
        result = await asyncio.wait_for(done, 10)
        await client.shutdown(5)
        return request, result

    request, result = run(main())
    assert len(backend.made["rt-aborted"]) <= 2 and sum(read.get("rt-aborted", [])) < 97
    assert read["rt-done"] == [1, 16, 16] and backend.made["rt-done"] == [1, 16, 16]
    assert request.state is None and {"prepare", "diffuse", "decode"} <= set(result.stage_seconds)
    assert {"rt-aborted", "rt-done"} <= set(backend.released) and not backend.live


class _HeldEnd(FakeBackend):
    """A streamed decode whose end (after its last chunk was made) waits for `release_end`; a non-streamed
    answer when `arrays` (a backend that cannot stream)."""

    def __init__(self, arrays: bool = False):
        super().__init__()
        self.arrays, self.release_end = arrays, threading.Event()

    def decode(self, state, *, stream=False):
        if self.arrays:
            return super().decode(state, stream=False)
        result = super().decode(state, stream=stream)
        chunks = result.frames.chunks

        def held():
            yield from chunks
            self.release_end.wait(5)

        result.frames.chunks = held()
        return result


class _FailingMetrics:
    def on_step(self, seconds, batch_size):
        pass

    def on_finished(self, *args):
        raise RuntimeError("metrics broke")

    def on_failed(self, code):
        pass


@pytest.mark.parametrize("case", ["abort after the last chunk", "a backend that cannot stream"])
def test_a_streamed_request_ends_once_with_its_frames_read(tmp_path, case):
    """An abort after the last chunk was made is too late: the reader finishes and the caller gets the result,
    once (not also CancelledRequest); a backend that answers stream=True with one array still goes through
    `on_frames`; an observer that fails does not keep the result from its caller."""
    from worldserve.engine.request import Request

    backend = _HeldEnd(arrays=case == "a backend that cannot stream")
    outcomes, read, all_read = [], [], threading.Event()

    def on_frames(result):
        for chunk in result.frames:
            read.append(len(chunk))
            if sum(read) == 33:
                all_read.set()

    async def main():
        client = make_client(tmp_path, backend=backend)
        client.engine.observer = _FailingMetrics()
        await client.start()
        client.engine.add_request(Request(job_id="rt", params=job_params(frames=33), arrival_time=time.monotonic(),
                                          on_result=outcomes.append, on_frames=on_frames))  # fmt: skip
        await asyncio.to_thread(all_read.wait, 5)
        client.engine.abort("rt")
        backend.release_end.set()
        await asyncio.to_thread(wait_until, lambda: outcomes and not backend.live)
        await asyncio.sleep(0.2)  # (a second outcome would come now)
        await client.shutdown(5)

    run(main())
    assert sum(read) == 33 and len(outcomes) == 1 and outcomes[0].fps == 8
