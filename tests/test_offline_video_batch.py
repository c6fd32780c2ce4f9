"""`Engine.generate_video(list)`, vLLM's `LLM.generate(prompts)` for videos: the outputs in order, each the MP4
its own call makes (tiny random checkpoint, CPU float32); same-shape items batched by the engine's scheduler,
interleaved shapes queued next to each other; every item checked before any runs, a bad one named
`prompt[i]...`; the first failure, the timeout or an interrupt aborting the rest (the fake backend, whose
`step_gate` holds a step with no clock and whose `__fail__:prepare` prompt fails one request).
"""

from __future__ import annotations

import contextlib
import signal
import threading

import numpy as np
import pytest
from media_probe import probe_mp4

SHAPE = {"width": 64, "height": 64, "num_frames": 5, "num_inference_steps": 2, "fps": 8}
SMALL = {"width": 32, "height": 32, "num_frames": 5}
"""The fake backend's requests: small MP4s to encode."""


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    """The tiny checkpoint, whose requests default to SHAPE (default_sampling_params, as serve's flag); a
    context long enough for the Reasoner to write a prompt (upsample_prompt)."""
    from worldserve import Engine

    with Engine(tiny_ckpt, device="cpu", dtype="float32", max_model_len=8192, max_batch_size=2,
                default_sampling_params={"0": SHAPE}) as engine:  # fmt: skip
        yield engine


@pytest.fixture(scope="module")
def fake():
    """The fake backend (numpy frames, no model): each denoise call recorded (`batch_sizes`)."""
    from worldserve import Engine

    with Engine(None, backend="fake", max_batch_size=2) as engine:
        yield engine


def fake_backend(engine):
    # (private: the backend the Engine loaded; the fake one records its batches and can hold a step)
    return engine._parts.backend


@contextlib.contextmanager
def step_sizes(engine):
    """The batch sizes of the denoising steps the engine runs in the block, as `Engine.get_metrics()`'s
    `worldserve:step_batch_size` histogram tells them: the set of sizes seen, filled in at the block's end
    ({1}: every step one request; {2}: every step two; both: some of each)."""

    def histogram() -> tuple[int, float, int]:
        # (no series before the engine's first step)
        for h in (m for m in engine.get_metrics() if m.name == "worldserve:step_batch_size"):
            return h.count, h.sum, h.buckets["1.0"]
        return 0, 0.0, 0

    sizes: set[int] = set()
    count0, sum0, ones0 = histogram()
    yield sizes
    count, total, ones = histogram()
    steps, requests, alone = count - count0, total - sum0, ones - ones0
    if alone:
        sizes.add(1)
    if requests > alone:  # (the other steps: max_batch_size 2 here, so batches of two)
        sizes.add(2)
    assert steps == alone + (requests - alone) / 2, (steps, requests, alone)


def wait_until_idle(engine) -> None:
    """Until nothing is queued or running (a hang guard: no time is asserted)."""
    ended = threading.Event()
    for _ in range(6000):
        if engine.num_unfinished_requests == 0:
            ended.set()
            break
        ended.wait(0.01)
    assert ended.is_set()


def test_a_list_is_its_single_calls_byte_for_byte(engine):
    """Prompts and VideoParams of different shapes (no step shared: batched forwards round differently)
    give, in order, the MP4s their own calls give: the keyword fields on every item (the seed over a
    VideoParams' own), the engine's defaults on the prompts, an image for one item's image-to-video."""
    from PIL import Image

    from worldserve import VideoParams

    first = np.asarray(Image.new("RGB", (48, 32), (220, 110, 40)))
    cat = VideoParams(prompt="a cat", seed=5, **{**SHAPE, "width": 32, "height": 32})
    turn = VideoParams(prompt="the fox turns", image=first, **{**SHAPE, "width": 48, "height": 32})
    items = ["A red fox runs through fresh snow", cat, turn]
    with step_sizes(engine) as sizes:
        outputs = engine.generate_video(items, seed=11)
    assert set(sizes) == {1}
    singles = [engine.generate_video(item, seed=11) for item in items]
    assert [o.video for o in outputs] == [s.video for s in singles]
    assert [(o.seed, o.prompt, o.params.width) for o in outputs] == [
        (11, "A red fox runs through fresh snow", 64), (11, "a cat", 32), (11, "the fox turns", 48)
    ]  # fmt: skip
    assert probe_mp4(outputs[2].video).width == 48 and outputs[2].params.image is not None
    # a tuple is a list too; an empty one, nothing
    assert (
        engine.generate_video(("a cat",), seed=11)[0].video == engine.generate_video("a cat", seed=11).video
    )
    assert engine.generate_video([]) == []


def test_same_shape_items_are_batched(engine):
    """Two prompts of one shape denoise in one batched forward (max_batch_size=2), which one call after the
    other never do; without a seed each gets the default, 42, as its own call does. Batched, the frames are
    its own call's but for the rounding of the batched forward (pixels off by one before the encoder)."""
    prompts = ["A red fox runs through fresh snow", "A cat sleeps by the fire"]
    with step_sizes(engine) as sizes:
        batched = engine.generate_video(prompts, generate_sound=False)
    assert set(sizes) == {2}  # (queued in one piece: batched from the first step)
    with step_sizes(engine) as sizes:
        singles = [engine.generate_video(p, generate_sound=False) for p in prompts]
    assert set(sizes) == {1}
    assert [o.seed for o in batched] == [42, 42] and [o.prompt for o in batched] == prompts
    for output, single in zip(batched, singles, strict=True):
        frames = np.stack(probe_mp4(output.video, decode=True).frames).astype(np.int16)
        alone = np.stack(probe_mp4(single.video, decode=True).frames).astype(np.int16)
        # (0.04 levels apart on average here; another seed's video is about 20 apart)
        assert np.abs(frames - alone).mean() < 1


def test_interleaved_shapes_are_queued_together(fake):
    """[A, B, A, B] with max_batch_size=2: the two A's denoise together, then the two B's, every step a batch
    of 2 (queued in list order, the scheduler would step the oldest alone: 12 steps of one request; queued one
    by one, the engine could start the first A alone). The outputs in list order."""
    backend = fake_backend(fake)
    backend.batch_sizes.clear()
    a = {"width": 64, "height": 64}
    b = {"width": 32, "height": 32}
    items = [f"item {i}" for i in range(4)]
    from worldserve import VideoParams

    requests = [VideoParams(prompt=p, num_frames=5, num_inference_steps=3, **(a if i % 2 == 0 else b))
                for i, p in enumerate(items)]  # fmt: skip
    outputs = fake.generate_video(requests, generate_sound=False)
    assert [o.prompt for o in outputs] == items and [o.params.width for o in outputs] == [64, 32, 64, 32]
    # (queued in one piece: each pair admitted at one step boundary, whatever the threads' timing)
    assert backend.batch_sizes == [2] * 6


def test_every_item_is_checked_before_any_runs(fake):
    """A bad item is named `prompt[i]` (its prompt) or `prompt[i].<field>` (its field), a bad keyword by its
    name (every item's value), the message saying which item; the model's own checks included (the prompt's
    length); nothing is prepared before."""
    from worldserve import ParamError, VideoParams

    backend = fake_backend(fake)
    prepared = len(backend.released)
    cases = [
        ((["a fox", 3],), {}, "prompt[1]", "prompt[1]: prompt must be a string or a VideoParams, got int"),
        ((["a fox", VideoParams(prompt="a cat", width=65)],), {}, "prompt[1].width", "prompt[1]: width=65"),
        ((["a fox", "a cat"],), {"width": 65, "height": 64}, "width", "prompt[0]: width=65"),
        ((["a fox"],), {"steps": 2}, "steps", "'steps' is not a VideoParams field"),
        ((["a fox", "a cat", "x" * 300],), {"max_sequence_length": 4}, "prompt[2]", "prompt[2]: prompt is longer"),
        ((["a fox"],), {"timeout": 0}, "timeout", "timeout=0"),
        ((["a fox"],), {"image": "/no/such/image.png"}, "image", "cannot read"),
        # keywords named as the keywords, not as the HTTP fields the routes take them in
        ((["a fox", "a cat"],), {"width": 1280, "height": 1280}, "width", "prompt[0]: size 1280x1280 is above"),
        ((["a fox", "a cat"],), {"condition_video_keep": "middle"}, "condition_video_keep", "prompt[0]: "),
        ((["a fox", "a cat"],), {"upsample_prompt": True}, "upsample_prompt", "prompt[0]: prompt upsampling needs"),
        ((["a fox"],), {"image": np.zeros((8, 8, 3), np.uint8), "num_frames": 1}, "image", "prompt[0]: image-to"),
    ]  # fmt: skip
    for args, fields, param, message in cases:
        with pytest.raises(ParamError) as bad:
            fake.generate_video(*args, **fields)
        assert bad.value.param == param and str(bad.value).startswith(message), (param, str(bad.value))
    assert len(backend.released) == prepared and fake.num_unfinished_requests == 0


def test_a_failing_item_aborts_the_others(fake):
    """The first item fails as it is prepared: its error is raised, and the second (50 steps), held in its
    first step, is aborted by then: once the step ends it stops, released, nothing left running."""
    backend = fake_backend(fake)
    backend.step_gate = held = threading.Event()
    steps = backend.steps_done
    try:
        from worldserve.engine.fake_backend import FakeBackendError

        with pytest.raises(FakeBackendError, match="injected failure at prepare"):
            fake.generate_video(["__fail__:prepare", "a long one"], **{**SMALL, "num_inference_steps": 50})
    finally:
        held.set()
        backend.step_gate = None
    wait_until_idle(fake)
    assert backend.steps_done - steps <= 1 and not backend.live


@pytest.mark.parametrize("ending", ["timeout", "interrupt"])
def test_a_timeout_or_an_interrupt_aborts_the_whole_list(fake, ending):
    """`timeout` bounds the whole list: TimeoutError, and its requests (100 steps of 20 ms) stop at their next
    step; a KeyboardInterrupt in the caller does the same."""
    backend = fake_backend(fake)
    backend.step_delay = 0.02
    steps = backend.steps_done
    prompts = ["one", "two", "three"]
    try:
        if ending == "timeout":
            with pytest.raises(TimeoutError, match="aborted"):
                fake.generate_video(prompts, **SMALL, num_inference_steps=100, timeout=0.5)
        else:
            main = threading.get_ident()
            timer = threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT))
            timer.start()
            try:
                with pytest.raises(KeyboardInterrupt):
                    fake.generate_video(prompts, **SMALL, num_inference_steps=100)
            finally:
                timer.join()
    finally:
        backend.step_delay = 0.0
    wait_until_idle(fake)
    assert backend.steps_done - steps < 200 and not backend.live


def test_a_prompt_the_reasoner_writes_too_long_names_the_item(engine):
    """An item whose prompt upsampling fails as it runs (the written prompt past its max_sequence_length) is
    a ParamError naming `prompt[i].max_sequence_length` (it had been the engine's UpsamplingFailed)."""
    from worldserve import ParamError, VideoParams

    upsampled = VideoParams(prompt="a cat", upsample_prompt=True, max_sequence_length=150, **SHAPE)
    with pytest.raises(
        ParamError, match=r"^prompt\[1\]: prompt upsampling failed: .*max_sequence_length"
    ) as bad:
        engine.generate_video(["a fox", upsampled])
    assert bad.value.param == "prompt[1].max_sequence_length"
    wait_until_idle(engine)
