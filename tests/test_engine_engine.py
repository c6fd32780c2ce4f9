"""Engine + EngineClient on the FakeBackend: batching, joins at step boundaries, cancel, failure isolation,
encode overlap, drain/stop and restart recovery. Stub encoder unless the test is about the encoder."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time

import numpy as np
import pytest
from serving_helpers import make_client, stub_encoder, wait_until

from worldserve.engine.client import EncodeOptions, JobSpec, JobStatus, QueueFullError, ShuttingDownError
from worldserve.engine.fake_backend import FakeBackend, FakeState
from worldserve.media.frame_stream import FrameStream
from worldserve.params import VideoParams


def _params(
    prompt: str = "a cat", *, steps: int = 4, width: int = 64, frames: int = 5, seed: int = 1
) -> VideoParams:
    return VideoParams(prompt=prompt, width=width, height=64, num_frames=frames, num_inference_steps=steps,
                       seed=seed, fps=8.0)  # fmt: skip


def _spec(p: VideoParams) -> JobSpec:
    return JobSpec(model="test-model", prompt=p.prompt, size=f"{p.width}x{p.height}", seconds="1",
                   quality="default", fps=p.fps, num_frames=p.num_frames)  # fmt: skip


def _submit(client, p: VideoParams, encode: EncodeOptions | None = None):
    return client.submit(p, _spec(p), encode or EncodeOptions(), None)


def run(coro):
    return asyncio.run(coro)


def test_one_request_end_to_end(tmp_path):
    backend = FakeBackend()

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        job = _submit(
            client, _params(steps=3, seed=7), EncodeOptions(crf=0, codec_options={"preset": "fast"})
        )
        done = await asyncio.wait_for(client.wait(job.id), 10)
        await client.shutdown(5)
        return job, done

    job, done = run(main())
    assert done.status is JobStatus.COMPLETED and done.progress == 100
    assert set(done.stage_durations) >= {"prepare", "diffuse", "decode", "encode"}
    meta = json.loads((tmp_path / "videos" / f"{job.id}.mp4").read_bytes()[7:])
    assert meta["frames"] == [5, 64, 64, 3] and meta["audio"] == [2, 30000] and meta["fps"] == 8.0
    assert meta["crf"] == 0 and meta["codec_options"] == {"preset": "fast"}
    assert backend.batch_sizes == [1, 1, 1] and not backend.live, "three steps, state released"


def test_same_shape_requests_batch_and_join_at_step_boundaries(tmp_path):
    backend = FakeBackend(step_delay=0.02)

    async def main():
        client = make_client(tmp_path, backend=backend, max_batch_size=4)
        await client.start()
        first = _submit(client, _params(steps=20))
        await asyncio.to_thread(wait_until, lambda: client.get(first.id).progress >= 15)
        late = [_submit(client, _params(steps=3, seed=s)) for s in range(2)]
        other = _submit(client, _params(steps=2, width=128))  # different batch key
        jobs = [first, *late, other]
        results = await asyncio.wait_for(asyncio.gather(*(client.wait(j.id) for j in jobs)), 20)
        await client.shutdown(5)
        return results

    results = run(main())
    assert all(r.status is JobStatus.COMPLETED for r in results)
    assert max(backend.batch_sizes) == 3, f"the late pair joined the running request: {backend.batch_sizes}"
    assert backend.batch_sizes[0] == 1 and backend.batch_sizes[-2:] == [1, 1], "the 128-wide one runs alone"
    assert len(backend.batch_sizes) == 20 + 2, "joined steps cost nothing extra"


def test_progress_rises_step_by_step(tmp_path):
    backend = FakeBackend(step_delay=0.05)

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        job = _submit(client, _params(steps=5))
        seen = []
        while (current := client.get(job.id)).status is not JobStatus.COMPLETED:
            seen.append(current.progress)
            await asyncio.sleep(0.005)
        await client.shutdown(5)
        return seen

    seen = run(main())
    assert seen == sorted(seen) and len(set(seen) & {20, 40, 60, 80}) >= 3 and max(seen) < 100


def test_cancel_mid_job_releases_and_next_runs(tmp_path):
    backend = FakeBackend(step_delay=0.02)

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        victim = _submit(client, _params(steps=200))
        queued = _submit(client, _params(steps=200, seed=3))
        after = _submit(client, _params(steps=2))
        await asyncio.to_thread(wait_until, lambda: client.get(victim.id).progress >= 2)
        assert client.delete(queued.id).status is JobStatus.QUEUED
        assert client.delete(victim.id).status is JobStatus.IN_PROGRESS
        assert await asyncio.wait_for(client.wait(victim.id), 5) is None
        done = await asyncio.wait_for(client.wait(after.id), 10)
        await client.shutdown(5)
        return victim, done

    victim, done = run(main())
    assert done.status is JobStatus.COMPLETED
    assert victim.id in backend.released and not backend.live
    assert len(backend.batch_sizes) < 60, "the cancelled job stopped at a step boundary"
    assert not (tmp_path / "videos" / f"{victim.id}.mp4").exists()


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
        victim = _submit(client, _params(frames=97))  # frame 0 + 6 chunks of 16: 0.7 s of decode
        await asyncio.to_thread(backend.decoding.wait, 5)
        assert client.delete(victim.id).status is JobStatus.IN_PROGRESS
        gone = await asyncio.wait_for(client.wait(victim.id), 5)
        after = await asyncio.wait_for(client.wait(_submit(client, _params(seed=2)).id), 10)
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
    from worldserve.engine.engine import CancelledRequest
    from worldserve.engine.request import Request

    backend, engine_ref, outcome = _SlowDecode(step_delay=0.3), [], []

    async def main():
        client = make_client(tmp_path, backend=backend)
        engine_ref.append(client.engine)
        await client.start()
        job = _submit(client, _params(steps=1))
        image = Request(job_id="img-1", params=_params(steps=1, frames=1), arrival_time=time.monotonic(),
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


@pytest.mark.parametrize("stage", ["prepare", "denoise", "decode", "decode_stream", "encode"])
def test_a_failing_request_fails_alone(tmp_path, stage):
    """decode_stream: the decode fails after its first chunk reached the encoder (the encode stops, the job
    fails once); encode: the mux fails while the decode still streams (its later chunks are dropped)."""
    backend = FakeBackend()

    def encoder(frames, fps, audio, **kw):
        if frames.shape[2] == 96:
            raise RuntimeError("mux exploded")
        return stub_encoder(frames, fps, audio, **kw)

    async def main():
        client = make_client(tmp_path, backend=backend, max_batch_size=2, encoder=encoder)
        await client.start()
        bad = _params(f"x __fail__:{stage}", width=96 if stage == "encode" else 64)
        jobs = [_submit(client, bad), _submit(client, _params(width=80))]
        results = await asyncio.wait_for(asyncio.gather(*(client.wait(j.id) for j in jobs)), 10)
        health = client.health()
        await client.shutdown(5)
        return results, health

    (failed, ok), health = run(main())
    assert failed.status is JobStatus.FAILED and failed.error_code == 500
    assert failed.error_message.startswith("Video generation failed:")
    injected = "mux exploded" if stage == "encode" else f"injected failure at {stage}"
    assert failed.error_message.endswith(injected)
    assert ok.status is JobStatus.COMPLETED and health == (True, None)
    assert not backend.live


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
        job = _submit(client, _params(frames=41, seed=3))
        done = await asyncio.wait_for(client.wait(job.id), 20)
        await client.shutdown(5)
        return job, done

    job, done = run(main())
    assert done.status is JobStatus.COMPLETED
    nice, read = read[0], read[1:]
    assert nice >= 10, "the mux yields the CPUs to the engine thread"
    assert len(made) == len(read) == 4, "frame 0, then 16 + 16 + 8 frames"
    assert read[0] < made[-1], "the mux started before the decode made its last chunk"
    p = _params(frames=41, seed=3)
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
        a, b = _submit(client, _params(steps=2)), _submit(client, _params(steps=5, seed=2))
        await asyncio.wait_for(asyncio.gather(client.wait(a.id), client.wait(b.id)), 10)
        await client.shutdown(5)
        return client.get

    run(main())
    starts = [t for name, t in events if name == "encode-start"]
    ends = [t for name, t in events if name == "encode-end"]
    # b's five steps (0.1 s) ran inside a's 0.6 s encode; serially b's encode would start after a's ended.
    assert starts[1] < ends[0]


def test_queue_bound_and_shutdown_intake(tmp_path):
    backend = FakeBackend(step_delay=0.05)

    async def main():
        client = make_client(tmp_path, backend=backend, max_queued_requests=2)
        await client.start()
        running = _submit(client, _params(steps=100))
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)
        _submit(client, _params())
        _submit(client, _params())
        with pytest.raises(QueueFullError) as full:
            _submit(client, _params())
        assert full.value.retry_after_s >= 1
        waiter = asyncio.create_task(client.wait(running.id))
        client.begin_shutdown(0.2)
        with pytest.raises(ShuttingDownError):
            _submit(client, _params())
        await client.shutdown(0.2)
        with pytest.raises(ShuttingDownError):
            await waiter
        return running

    running = run(main())
    # The hard stop parked the running job: it is queued again, to resume at the next start.
    from worldserve.engine.jobs import JobStore

    store = JobStore(tmp_path)
    assert store.get(running.id).status is JobStatus.QUEUED
    assert store.count(JobStatus.QUEUED) == 3


def test_restart_resumes_unfinished_jobs(tmp_path):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (20, 12), (10, 200, 30)).save(buf, format="PNG")
    png = buf.getvalue()

    async def first_life():
        client = make_client(tmp_path, backend=FakeBackend(step_delay=0.05))
        await client.start()
        p = _params(steps=100)
        running = client.submit(p, _spec(p), EncodeOptions(crf=5), png)
        lost = client.submit(p, _spec(p), EncodeOptions(), png)
        await asyncio.to_thread(wait_until, lambda: client.get(running.id).progress > 0)
        client.engine.stop(0)  # what a crash leaves: one row in_progress, one queued
        client.store.close()  # the dead process's storage lock goes with it
        return running, lost

    running, lost = run(first_life())
    (tmp_path / "inputs" / f"{lost.id}.ref").unlink()

    async def second_life():
        backend = FakeBackend()
        client = make_client(tmp_path, backend=backend)
        await client.start()
        results = await asyncio.wait_for(asyncio.gather(client.wait(running.id), client.wait(lost.id)), 10)
        await client.shutdown(5)
        return results

    resumed, failed = run(second_life())
    assert resumed.status is JobStatus.COMPLETED
    meta = json.loads((tmp_path / "videos" / f"{running.id}.mp4").read_bytes()[7:])
    assert meta["crf"] == 5
    assert failed.status is JobStatus.FAILED and "reference image is missing" in failed.error_message


def test_waiters_are_woken_from_the_engine_thread(tmp_path):
    async def main():
        client = make_client(tmp_path)
        await client.start()
        jobs = [_submit(client, _params(steps=1, seed=i)) for i in range(20)]
        results = await asyncio.wait_for(asyncio.gather(*(client.wait(j.id) for j in jobs)), 10)
        await client.shutdown(5)
        return results, threading.active_count()

    results, _ = run(main())
    assert all(r.status is JobStatus.COMPLETED for r in results)


def test_ephemeral_requests_are_cancelled_at_shutdown_and_leave_the_queue_alone(tmp_path):
    """Image requests (no job): at a shutdown the running one and the one still waiting are cancelled
    (503 for their callers, they cannot resume); a queued video job stays queued for the next start."""
    from worldserve.engine.engine import CancelledRequest

    backend = FakeBackend(step_delay=0.05)

    async def main():
        client = make_client(tmp_path, backend=backend, max_batch_size=1)
        await client.start()
        images = asyncio.ensure_future(
            client.generate_ephemeral(
                [_params(steps=200), _params(steps=200, seed=2)], prefix="img", timeout_s=30
            )
        )
        for _ in range(500):  # the loop must run for the requests to reach the engine
            if client.engine.num_running == 1:
                break
            await asyncio.sleep(0.01)
        queued_video = _submit(client, _params(steps=3))
        await client.shutdown(0.1)
        with pytest.raises(CancelledRequest) as cancelled:
            await asyncio.wait_for(images, 5)
        return client, queued_video, cancelled.value

    from worldserve.engine.jobs import JobStore

    _, job, exc = run(main())
    assert exc.status_code == 503
    assert not backend.live, "the running image request was released"
    store = JobStore(tmp_path)  # as the next start sees it: the video job, queued; no trace of the images
    assert [j.id for j in store.list(after=None, limit=None, order="asc")[0]] == [job.id]
    assert store.get(job.id).status is JobStatus.QUEUED


def test_an_ephemeral_request_after_the_loop_ended_is_cancelled_at_once(tmp_path):
    import time as _time

    from worldserve.engine.engine import CancelledRequest
    from worldserve.engine.request import Request

    async def main():
        client = make_client(tmp_path)
        await client.start()
        await client.shutdown(0.1)
        return client

    client = run(main())
    outcomes = []
    client.engine.add_request(Request(job_id="img-late", params=_params(), arrival_time=_time.monotonic(),
                                      on_result=outcomes.append))  # fmt: skip
    assert len(outcomes) == 1 and isinstance(outcomes[0], CancelledRequest) and client.engine.num_waiting == 0


def test_deleted_queued_jobs_free_their_queue_slots_at_once(tmp_path):
    """A queued job deleted while the engine is inside a long step no longer counts against the queue bound
    (the loop itself only sees the abort at its next step boundary)."""
    backend = FakeBackend(step_delay=1.0)

    async def main():
        client = make_client(tmp_path, backend=backend, max_queued_requests=2)
        await client.start()
        _submit(client, _params(steps=100))
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)
        queued = [_submit(client, _params(seed=s)) for s in range(2)]
        with pytest.raises(QueueFullError):
            _submit(client, _params())
        for job in queued:
            assert client.delete(job.id) is not None
        assert client.engine.num_waiting == 0
        fresh = _submit(client, _params())  # no 429: the deleted jobs' slots are free
        assert client.get(fresh.id).status is JobStatus.QUEUED
        await client.shutdown(0.1)

    run(main())


def test_shutdown_answers_waiters_of_queued_jobs_at_once_and_the_rest_after_the_timeout(tmp_path):
    """On shutdown a sync waiter whose job stays queued is answered right away; one whose job runs gets its
    answer after the shutdown timeout even while the engine is still inside a long step."""
    backend = FakeBackend(step_delay=3.0)

    async def main():
        client = make_client(tmp_path, backend=backend)
        await client.start()
        running = _submit(client, _params(steps=100))
        await asyncio.to_thread(wait_until, lambda: client.engine.num_running == 1)
        queued = _submit(client, _params(seed=1))
        waiters = [asyncio.create_task(client.wait(j.id)) for j in (running, queued)]
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        client.begin_shutdown(0.5)
        with pytest.raises(ShuttingDownError):
            await waiters[1]
        assert time.monotonic() - t0 < 0.3
        with pytest.raises(ShuttingDownError):
            await waiters[0]
        assert 0.4 < time.monotonic() - t0 < 2.0  # the timeout, not the 3 s step
        await client.shutdown(0.5)

    run(main())


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
        done = await asyncio.wait_for(client.wait(_submit(client, _params()).id), 10)
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
        done = await asyncio.wait_for(client.wait(_submit(client, _params(frames=17)).id), 10)
        await asyncio.to_thread(wait_until, lambda: held and held[0]() is None, 2.0)
        alive = held[0]() is not None
        await client.shutdown(5)
        return done, alive

    # pytest's log capture would keep the failure's record, and with it the traceback (a log handler that
    # writes the record and drops it, as the server's, does not)
    monkeypatch.setattr(logging.getLogger("worldserve.engine.engine"), "propagate", False)
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
        done = await asyncio.wait_for(client.wait(_submit(client, _params()).id), 10)
        await client.shutdown(5)
        return done

    done = run(main())
    assert done.status is JobStatus.FAILED and "not an Exception" in done.error_message
