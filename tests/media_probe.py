"""Test helper: decode MP4 bytes with PyAV and report what a client would see.

`probe_mp4(data)` returns an `Mp4Probe`: stream codecs, pixel format, colour tags, the decoded video frame
count and frame rate, and for the audio track its sample rate, channel count, container duration (from the
MP4 edit list, i.e. without the AAC priming and tail padding), decoded sample count and first pts.
Optionally it also returns the decoded RGB frames and the decoded audio waveform.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class Mp4Probe:
    container_format: str
    """FFmpeg demuxer name(s), e.g. "mov,mp4,m4a,3gp,3g2,mj2"."""
    video_codec: str
    pix_fmt: str
    width: int
    height: int
    num_frames: int
    """Frames actually decoded."""
    fps: Fraction
    """The stream's average frame rate."""
    video_duration: float
    """Seconds, from the stream duration."""
    colorspace: int
    """AVColorSpace tag of the stream (1 = BT.709)."""
    audio_codec: str | None = None
    sample_rate: int | None = None
    channels: int | None = None
    audio_duration: float | None = None
    """Seconds, from the stream duration (edit list): the intended playback length."""
    audio_samples_decoded: int | None = None
    """Samples per channel the decoder produced (the last AAC frame is padded to 1024)."""
    first_audio_pts: int | None = None
    frames: np.ndarray | None = None
    """uint8 (F, H, W, 3) when decoded with `decode=True`."""
    audio: np.ndarray | None = None
    """float32 (C, N) when decoded with `decode=True`."""


def probe_mp4(data: bytes, *, decode: bool = False) -> Mp4Probe:
    with av.open(io.BytesIO(data)) as container:
        vstream = container.streams.video[0]
        astream = container.streams.audio[0] if container.streams.audio else None
        frames, chunks = [], []
        num_frames, samples, first_pts = 0, 0, None
        for frame in container.decode(*(s for s in (vstream, astream) if s is not None)):
            if isinstance(frame, av.VideoFrame):
                num_frames += 1
                if decode:
                    frames.append(frame.to_ndarray(format="rgb24"))
            else:
                if first_pts is None:
                    first_pts = frame.pts
                samples += frame.samples
                if decode:
                    chunks.append(frame.to_ndarray())
        vctx = vstream.codec_context
        audio_fields = {}
        if astream is not None:
            audio_fields = dict(
                audio_codec=astream.codec_context.name,
                sample_rate=astream.codec_context.sample_rate,
                channels=astream.codec_context.channels,
                audio_duration=float(astream.duration * astream.time_base),
                audio_samples_decoded=samples,
                first_audio_pts=first_pts,
                audio=np.concatenate(chunks, axis=1).astype(np.float32) if decode and chunks else None,
            )
        return Mp4Probe(
            container_format=container.format.name,
            video_codec=vctx.name,
            pix_fmt=vctx.pix_fmt,
            width=vctx.width,
            height=vctx.height,
            num_frames=num_frames,
            fps=Fraction(vstream.average_rate),
            video_duration=float(vstream.duration * vstream.time_base),
            colorspace=int(vctx.colorspace),
            frames=np.stack(frames) if decode and frames else None,
            **audio_fields,
        )
