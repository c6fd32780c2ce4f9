"""A numpy-only `VideoBackend` for tests (and `worldserve serve --backend fake`): no model, no torch.

Frames are deterministic in the seed: frame i is one flat colour drawn from `default_rng(seed)`, returned as
a broadcast view (no memory even at 720p x 189 frames). Audio, when on, is a seed-dependent stereo sine at
48 kHz covering num_frames / fps seconds. Each `denoise` call sleeps `step_delay` seconds (a stand-in for
GPU time) and records its batch size, so engine-policy tests can assert on batching. A prompt holding the word
`__fail__:prepare`, `__fail__:denoise` or `__fail__:decode` raises at that stage, `__fail__:decode_stream`
after a streamed decode's first chunk (failure-isolation tests). `decode(stream=True)` streams frame 0 and
then 16 frames a chunk (the real decoder makes 4 per latent frame of its chunk: 8 by default), each after `decode_chunk_delay` seconds (counted in `decoded_chunks`).
A test that must hold a step or a decode chunk in progress (to see what happens meanwhile, with no clock)
passes `step_gate` / `chunk_gate`: each denoise call, and each streamed chunk after frame 0, then waits for
that event to be set before it ends (`steps_done` counts the denoise calls completed).
It never changes the outputs of one request because of another one in its batch.
Token counts (VideoResult.prompt_tokens / gen_tokens, the image route's `usage`) are modelled, not measured:
the prompt through a byte tokenizer (its UTF-8 bytes), the gen tokens from Cosmos3-Nano's geometry (Wan2.2
VAE 16x spatial / 4x temporal, 2x2 patches, sound latents at 48 kHz / 1920), as the real pipeline counts them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from worldserve.engine.outputs import VideoResult
from worldserve.media.frame_stream import FrameStream
from worldserve.media.video import clip_samples
from worldserve.params import ParamError, VideoParams

FAIL_MARKER = "__fail__:"
SAMPLE_RATE = 48000
VAE_SPATIAL, VAE_TEMPORAL, PATCH, SOUND_HOP = 16, 4, 2, 1920
"""Cosmos3-Nano's latent geometry, for the modelled gen token count (`gen_tokens`)."""


@dataclass(slots=True, eq=False)
class FakeState:
    request_id: str
    step_index: int
    num_steps: int
    params: VideoParams
    prompt_tokens: int = 0
    gen_tokens: int = 0

    @property
    def batch_key(self) -> Hashable:
        p = self.params
        return (p.width, p.height, p.num_frames)


class FakeBackendError(RuntimeError):
    """Raised on purpose by a `__fail__:<stage>` prompt."""


class FakeBackend:
    def __init__(
        self, *, step_delay: float = 0.0, has_sound: bool = True, decode_chunk_delay: float = 0.0,
        step_gate: threading.Event | None = None, chunk_gate: threading.Event | None = None,
    ):  # fmt: skip
        self.has_sound = has_sound
        self.step_delay = step_delay
        self.decode_chunk_delay = decode_chunk_delay
        self.step_gate = step_gate
        """When given, every denoise call waits for it to be set before it ends (a step held in progress)."""
        self.chunk_gate = chunk_gate
        """When given, every streamed chunk after frame 0 waits for it to be set before it is made."""
        self.steps_done = 0
        """Denoise calls completed, all requests together."""
        self.decoded_chunks = 0
        """Chunks of frames a streamed decode has made, all requests together."""
        self.batch_sizes: list[int] = []
        """Size of every denoise call, in order."""
        self.live: set[str] = set()
        """Request ids prepared and not yet released (a leak shows here)."""
        self.released: list[str] = []
        self._lock = threading.Lock()

    def problem(self) -> str | None:
        return None

    def validate(self, params: VideoParams) -> VideoParams:
        if params.generate_sound and not self.has_sound:
            raise ParamError(
                "generate_sound", "this checkpoint has no sound tokenizer; set generate_sound=false"
            )
        if len(params.prompt) > 64 * params.max_sequence_length:  # a byte-ish tokenizer bound
            raise ParamError("prompt", "prompt is longer than max_sequence_length tokens")
        return params

    def prepare(self, request_id: str, params: VideoParams) -> FakeState:
        _maybe_fail(params, "prepare")
        with self._lock:
            self.live.add(request_id)
        return FakeState(
            request_id, 0, params.num_inference_steps, params, prompt_tokens=len(params.prompt.encode("utf-8")),
            gen_tokens=gen_tokens(params, self._sound(params)),
        )  # fmt: skip

    def denoise(self, states: Sequence[FakeState]) -> None:
        assert len({s.batch_key for s in states}) == 1, "a batch mixes batch keys"
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.step_gate is not None:
            self.step_gate.wait()
        for state in states:
            _maybe_fail(state.params, "denoise")
        for state in states:
            assert state.step_index < state.num_steps, "denoised past the last step"
            state.step_index += 1
        self.batch_sizes.append(len(states))
        self.steps_done += 1

    def decode(self, state: FakeState, *, stream: bool = False) -> VideoResult:
        p = state.params
        _maybe_fail(p, "decode")
        rng = np.random.default_rng(p.seed % 2**64)  # int64 seeds, as torch.Generator.manual_seed takes them
        colours = rng.integers(0, 256, size=(p.num_frames, 1, 1, 3), dtype=np.uint8)
        frames = np.broadcast_to(colours, (p.num_frames, p.height, p.width, 3))
        audio = None
        if self._sound(p):
            n = clip_samples(p.num_frames, p.fps, SAMPLE_RATE)
            t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
            freq = 220.0 + float(rng.integers(0, 440))
            tone = 0.2 * np.sin(2 * np.pi * freq * t, dtype=np.float32)
            audio = np.stack([tone, tone * 0.5]).astype(np.float32)
        out = FrameStream(p.num_frames, p.height, p.width, self._chunks(frames, p)) if stream else frames
        return VideoResult(frames=out, fps=p.fps, audio=audio, sample_rate=SAMPLE_RATE,
                           prompt_tokens=state.prompt_tokens, gen_tokens=state.gen_tokens)  # fmt: skip

    def _sound(self, params: VideoParams) -> bool:
        """Whether a request gets audio: its generate_sound, else whether the backend has sound and the
        request is a video (VideoPipeline.sound_enabled: none for one frame, an image)."""
        if params.generate_sound is None:
            return self.has_sound and params.num_frames > 1
        return bool(params.generate_sound)

    def release(self, state: FakeState) -> None:
        with self._lock:
            self.live.discard(state.request_id)
            self.released.append(state.request_id)

    def _chunks(self, frames: np.ndarray, params: VideoParams) -> Iterator[np.ndarray]:
        """Frame 0, then 16 frames a chunk; FAIL_MARKER + "decode_stream" fails
        the stream after its first chunk."""
        self.decoded_chunks += 1
        yield frames[:1]
        for start in range(1, len(frames), 16):
            _maybe_fail(params, "decode_stream")
            time.sleep(self.decode_chunk_delay)
            if self.chunk_gate is not None:
                self.chunk_gate.wait()
            self.decoded_chunks += 1
            yield frames[start : start + 16]


def gen_tokens(params: VideoParams, sound: bool) -> int:
    """The gen tokens Cosmos3-Nano denoises for `params` (runner/video_state.py count_gen_tokens): the
    patches of its latent frames but the clean conditioning ones, plus its sound latents with `sound`."""
    frames = (params.num_frames - 1) // VAE_TEMPORAL + 1
    per_frame = -(-params.height // VAE_SPATIAL // PATCH) * -(-params.width // VAE_SPATIAL // PATCH)
    if params.image is not None:
        clean = {0}
    elif params.video is not None:
        clean = {i for i in params.condition_frame_indexes if 0 <= i < frames}
    else:
        clean = set()
    samples = int(params.num_frames / params.fps * SAMPLE_RATE)
    return (frames - len(clean)) * per_frame + (-(-samples // SOUND_HOP) if sound else 0)


def _maybe_fail(params: VideoParams, stage: str) -> None:
    """Raise at `stage` when the prompt holds the word FAIL_MARKER + stage (exactly: `decode` is not
    `decode_stream`)."""
    if FAIL_MARKER + stage in params.prompt.split():
        raise FakeBackendError(f"injected failure at {stage}")
