"""Audio VAE decoder (Cosmos3 AVAE: 64-channel latents at 25 Hz -> 48 kHz stereo, hop 1920): diffusers'
Cosmos3AVAEAudioTokenizer (decoder only) behind our interface (cosmos3-model.md §7).

Length maths (§4, §5.6): a `num_frames` video at `fps` carries `int(num_frames / fps * sample_rate)`
samples; the generated sound latent has `T_s = ceil(samples / hop)` frames (exactly how diffusers 0.42.1
computes it in `prepare_latents`: 189 @ 24 fps -> 378000 samples -> 197; 9 @ 24 -> 18000 -> 10).
The decoder returns `T_s * hop` samples, clamped to [-1, 1]; `decode` trims (or zero-pads) that to the
requested length, as cosmos-framework and vllm-omni do (diffusers returns it untrimmed).

The decoder's convolutions use legacy weight norm, recomputed from (g, v) on every forward; by default it is
folded once at load (cosmos-framework calls `remove_weight_norm()` too): the same weights, computed once.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from diffusers import Cosmos3AVAEAudioTokenizer


def fold_weight_norm(module: torch.nn.Module) -> int:
    """Replace every legacy weight-norm (weight_g, weight_v) pair under `module` by its plain weight."""
    folded = 0
    for sub in module.modules():
        if hasattr(sub, "weight_g") and hasattr(sub, "weight_v"):
            torch.nn.utils.remove_weight_norm(sub)
            folded += 1
    return folded


class AudioVAE:
    """A loaded AVAE sound tokenizer, used to decode generated sound latents."""

    def __init__(self, model: Cosmos3AVAEAudioTokenizer, *, fold: bool = True):
        self.model = model.eval().requires_grad_(False)
        if fold:
            fold_weight_norm(self.model.decoder)

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        fold: bool = True,
    ) -> AudioVAE:
        """Load from a checkpoint's `sound_tokenizer/` folder (decoder-only weights are fine)."""
        from worldserve.weights.checkpoint import load_diffusers_component

        with warnings.catch_warnings():  # (diffusers builds it with the deprecated weight_norm; we fold it)
            warnings.simplefilter("ignore", FutureWarning)
            model = load_diffusers_component(Cosmos3AVAEAudioTokenizer, folder, dtype=dtype)
        return cls(model.to(device), fold=fold)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.decoder.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.decoder.parameters()).device

    @property
    def sample_rate(self) -> int:
        return int(self.model.config.sampling_rate)

    @property
    def hop_size(self) -> int:
        """Waveform samples per latent frame (1920 = 2*4*5*6*8)."""
        return int(self.model._hop_size)

    @property
    def latent_channels(self) -> int:
        return int(self.model.config.vocoder_input_dim)

    @property
    def channels(self) -> int:
        """Output audio channels (2: stereo)."""
        return int(self.model.config.dec_out_channels)

    def num_samples(self, num_frames: int, fps: float) -> int:
        """Samples per channel that cover the video as diffusers counts them for the sound latent's length:
        `int(num_frames / fps * sample_rate)`, in floats (the MP4's track is media/video.py's clip_samples,
        exact: this count is one short where the float falls just under a whole number)."""
        return int(num_frames / fps * self.sample_rate)

    def latent_frames(self, num_frames: int, fps: float) -> int:
        """Sound latent length T_s = ceil(num_samples / hop), integer arithmetic as diffusers does."""
        return (self.num_samples(num_frames, fps) + self.hop_size - 1) // self.hop_size

    @torch.inference_mode()
    def decode_waveform(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, 64, T_s] -> float32 waveform [B, C, T_s * hop] in [-1, 1] (on the device, untrimmed)."""
        if latents.ndim != 3 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"latents must be [B, {self.latent_channels}, T], got {tuple(latents.shape)}")
        wave = self.model.decode(latents.to(device=self.device, dtype=self.dtype))  # clamps to [-1, 1]
        return wave.to(torch.float32)

    def decode(self, latents: torch.Tensor, num_samples: int) -> np.ndarray:
        """Latents [64, T_s] or [B, 64, T_s] -> host float32 (C, num_samples) or (B, C, num_samples):
        the decoded waveform trimmed, or zero-padded, to `num_samples`."""
        squeeze = latents.ndim == 2
        wave = self.decode_waveform(latents[None] if squeeze else latents)
        n = min(num_samples, wave.shape[-1])
        out = np.zeros((*wave.shape[:2], num_samples), dtype=np.float32)
        out[..., :n] = wave[..., :n].cpu().numpy()
        return out[0] if squeeze else out
