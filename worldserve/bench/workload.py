"""A benchmark point: pixel size, frames, fps and prompt lengths, and the latent / token shapes they imply.

Shapes follow cosmos3-model.md §4: Wan2.2 latent `[48, 1 + (F-1)//4, H/16, W/16]`, 2x2 patches with odd
latent sizes padded (720p: 45 -> 46 rows, 23 x 40 = 920 tokens a frame), audio latent
`ceil(int(F/fps*48000) / 1920)` frames at 25 Hz (197 at 189 frames). Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from worldserve.bench.flops import NANO, TowerShape, forward_flops, step_flops

VAE_SPATIAL = 16
VAE_TEMPORAL = 4
LATENT_CHANNELS = 48
PATCH = 2
AUDIO_RATE = 48000
AUDIO_HOP = 1920


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    width: int = 1280
    """Pixel width (multiple of 16)."""
    height: int = 720
    """Pixel height (multiple of 16)."""
    num_frames: int = 189
    """Pixel frames (4k + 1)."""
    fps: float = 24.0
    """Frame rate (mRoPE modulation and audio length)."""
    sound: bool = True
    """Joint audio generation."""
    cond_text: int = 300
    """Text (und) tokens of the positive prompt, template included."""
    uncond_text: int = 300
    """Text tokens of the negative prompt (CFG branch)."""

    def __post_init__(self) -> None:
        if (
            min(self.width, self.height) < VAE_SPATIAL
            or self.width % VAE_SPATIAL
            or self.height % VAE_SPATIAL
        ):
            raise ValueError(f"{self.width}x{self.height}: width and height must be positive multiples of 16")
        if self.num_frames < 1 or (self.num_frames - 1) % VAE_TEMPORAL:
            raise ValueError(f"num_frames={self.num_frames} must be 4k+1")
        if self.cond_text < 1 or self.uncond_text < 1:
            raise ValueError("prompts need at least one token")

    @property
    def label(self) -> str:
        return f"{self.width}x{self.height}x{self.num_frames}" + ("+audio" if self.sound else "")

    @property
    def latent_shape(self) -> tuple[int, int, int, int, int]:
        """[1, 48, T, H, W] of the Wan2.2 latent."""
        t = 1 + (self.num_frames - 1) // VAE_TEMPORAL
        return (1, LATENT_CHANNELS, t, self.height // VAE_SPATIAL, self.width // VAE_SPATIAL)

    @property
    def patch_grid(self) -> tuple[int, int, int]:
        _, _, t, h, w = self.latent_shape
        return (t, math.ceil(h / PATCH), math.ceil(w / PATCH))

    @property
    def video_tokens(self) -> int:
        t, h, w = self.patch_grid
        return t * h * w

    @property
    def audio_samples(self) -> int:
        return int(self.num_frames / self.fps * AUDIO_RATE)

    @property
    def audio_frames(self) -> int:
        """Audio latent frames (0 without sound)."""
        return math.ceil(self.audio_samples / AUDIO_HOP) if self.sound else 0

    @property
    def gen_tokens(self) -> int:
        return self.video_tokens + self.audio_frames

    @property
    def text_tokens(self) -> tuple[int, int]:
        return (self.cond_text, self.uncond_text)

    def forward_flops(self, shape: TowerShape = NANO) -> tuple[float, float]:
        """(cond, uncond) model FLOPs of one forward."""
        cond, uncond = self.text_tokens
        return forward_flops(self.gen_tokens, cond, shape), forward_flops(self.gen_tokens, uncond, shape)

    def step_flops(self, shape: TowerShape = NANO) -> float:
        return step_flops(self.gen_tokens, self.text_tokens, shape)


def parse_point(spec: str, **kw: Any) -> Workload:
    """'1280x720x189' -> Workload(width=1280, height=720, num_frames=189, **kw)."""
    try:
        w, h, f = (int(x) for x in spec.lower().split("x"))
    except ValueError as e:
        raise ValueError(f"{spec!r} is not WIDTHxHEIGHTxFRAMES") from e
    return Workload(width=w, height=h, num_frames=f, **kw)
