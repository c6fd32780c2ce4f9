"""Video VAE (Wan2.2, 48 latent channels, 4x temporal / 16x spatial): diffusers' AutoencoderKLWan for encode,
our chunked channels-last decoder (`wan_decoder.WanDecoder`, same weights and numbers) for decode, behind our
interface, with the Cosmos3 latent normalisation (cosmos3-model.md §6).

- `encode_condition(image, num_frames)`: the I2V conditioning latent. diffusers 0.42.1 (our oracle,
  `Cosmos3OmniPipeline.prepare_latents`) builds a `num_frames` video repeating the [-1, 1] image in every
  frame, encodes it (posterior mean) and normalises; cosmos-framework (the reference) does the same
  (§5.3 step 2). Only latent frame 0 is used (mask [1, 0, ...]); because the VAE is causal and encodes
  pixel frame 0 alone as its first chunk, `first_frame_only=True` yields exactly that frame from a
  one-frame encode, at a fraction of the cost (189x less pixel input at 720p).
- `encode_video(frames)`: the V2V conditioning latents of a clip (uint8, already resized), normalised.
- `decode(latents)`: normalised latents [B, 48, T, h, w] -> uint8 frames (B, F, H, W, 3) on the host,
  F = 4(T-1)+1, the same ops as the pipeline's decode + `VideoProcessor.postprocess_video` +
  `numpy_to_pil`: `z = z_n / inv_std + mean` in the VAE dtype, decode (clamped to [-1, 1]), cast to
  float32, `(x*0.5+0.5).clamp(0,1)`, `(x*255).round()`; the uint8 conversion runs on the device.
  `decode_frames(latents)` gives the same frames chunk by chunk as the decoder makes them (each copied to
  the host while the device decodes the next), for an MP4 mux that runs while the decode goes on.
  The decode runs `WanDecoder` (a copy of the diffusers decoder's weights: ~1e-7 relative to
  diffusers in float32 on the CPU, built to be faster on a GPU: bench/vae_decode.py measures it);
  `use_reference_decoder=True` keeps diffusers' decode for A/B, and `tiling=True` uses diffusers' tiled
  decode.

Normalisation constants live as tensors in the VAE dtype (`1/std` is computed in that dtype, as diffusers
and the reference do). diffusers keeps a per-call causal-conv cache on the module, and a decode holds
GBs of activations at 720p, so encode/decode are serialised with a lock: one call at a time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKLWan

from worldserve.models.cosmos3.wan_decoder import DEFAULT_CHUNK_SIZE, WanDecoder


class VideoVAE:
    """A loaded Wan2.2 VAE plus the Cosmos3 latent statistics."""

    def __init__(
        self,
        model: AutoencoderKLWan,
        *,
        tiling: bool = False,
        use_reference_decoder: bool = False,
        decode_chunk_size: int = DEFAULT_CHUNK_SIZE,
        compile_decoder: bool = False,
        time_winograd: bool = True,
    ):
        """`use_reference_decoder`: decode with diffusers (A/B) instead of our `WanDecoder`; `tiling`:
        diffusers' tiled decode (also instead of ours); `decode_chunk_size`: latent frames per chunk of our
        decoder (at 720p bf16 ~6 + 3.3 GB a chunk frame, see wan_decoder.py); `compile_decoder`:
        torch.compile its hot blocks (meant for CUDA; the first decode of a shape then compiles);
        `time_winograd`: the residual convs as Winograd F(2, 3) in time (1.23x the compiled 720p decode on
        an H200, +6.4 GiB of peak decode memory) or as plain Conv3d calls."""
        if decode_chunk_size < 1:
            raise ValueError(f"decode_chunk_size must be >= 1, got {decode_chunk_size}")
        self.model = model.eval().requires_grad_(False)
        cfg = model.config
        dtype, device = model.dtype, model.device
        # Built on the host in the VAE dtype, then moved, exactly like the pipeline (bit-identical inv_std).
        self.latents_mean = torch.tensor(cfg.latents_mean, dtype=dtype).to(device)
        self.latents_inv_std = (1.0 / torch.tensor(cfg.latents_std, dtype=dtype)).to(device)
        self.tiling = tiling
        if tiling:
            model.enable_tiling()
        self.decode_chunk_size = decode_chunk_size
        self.decoder: WanDecoder | None = None
        if not (tiling or use_reference_decoder):
            self.decoder = WanDecoder.from_diffusers(model)
            # diffusers' own decoder is never called again (encode needs only encoder + quant_conv): free its
            # weights (1.1 GB at full size) instead of holding two copies on the GPU.
            model.decoder = None
            model.post_quant_conv = None
            self.decoder.set_time_winograd(time_winograd)
            if compile_decoder:
                self.decoder.compile()
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        folder: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        tiling: bool = False,
        use_reference_decoder: bool = False,
        decode_chunk_size: int = DEFAULT_CHUNK_SIZE,
        compile_decoder: bool = False,
        time_winograd: bool = True,
    ) -> VideoVAE:
        """Load `AutoencoderKLWan` from a checkpoint's `vae/` folder (config.json + safetensors); our decoder
        copies its decoder weights (options as in `__init__`)."""
        from worldserve.weights.checkpoint import load_diffusers_component

        model = load_diffusers_component(AutoencoderKLWan, folder, dtype=dtype)
        return cls(
            model.to(device),
            tiling=tiling,
            use_reference_decoder=use_reference_decoder,
            decode_chunk_size=decode_chunk_size,
            compile_decoder=compile_decoder,
            time_winograd=time_winograd,
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def z_dim(self) -> int:
        return int(self.model.config.z_dim)

    @property
    def scale_factor_spatial(self) -> int:
        return int(self.model.config.scale_factor_spatial)

    @property
    def scale_factor_temporal(self) -> int:
        return int(self.model.config.scale_factor_temporal)

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(C, T, h, w) of the latent of a `num_frames` x height x width video (T = (F-1)//4 + 1)."""
        s = self.scale_factor_spatial
        if height % s or width % s:
            raise ValueError(f"height and width must be multiples of {s}, got {height}x{width}")
        if num_frames < 1:
            raise ValueError(f"num_frames must be >= 1, got {num_frames}")
        return self.z_dim, (num_frames - 1) // self.scale_factor_temporal + 1, height // s, width // s

    def num_decoded_frames(self, latent_frames: int) -> int:
        """Pixel frames the decoder produces for T latent frames: 1 + 4(T-1)."""
        return 1 + self.scale_factor_temporal * (latent_frames - 1)

    def _stats(self, ndim: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1) + (1,) * (ndim - 2)  # broadcast over [B, C, T, h, w]
        return self.latents_mean.view(shape), self.latents_inv_std.view(shape)

    def normalize(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw posterior mean -> model latents: `(mu - mean) * inv_std`, in the VAE dtype."""
        mean, inv_std = self._stats(raw.ndim)
        return (raw.to(self.dtype) - mean) * inv_std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Model latents -> VAE latents: `z / inv_std + mean`, in the VAE dtype."""
        mean, inv_std = self._stats(latents.ndim)
        return latents.to(device=self.device, dtype=self.dtype) / inv_std + mean

    @torch.inference_mode()
    def encode_condition(
        self, image: np.ndarray, num_frames: int, *, first_frame_only: bool = False
    ) -> torch.Tensor:
        """uint8 (H, W, 3), already resized (`media.image.resize_center_crop`) -> float32 normalised
        latents [1, 48, T, h, w] of the image repeated over `num_frames` frames (T = 1 with
        `first_frame_only`, which equals latent frame 0 of the full encode)."""
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"image must be uint8 (H, W, 3), got {image.dtype} {image.shape}")
        height, width = image.shape[:2]
        self.latent_shape(num_frames, height, width)  # validates the size
        frames = 1 if first_frame_only else num_frames
        pixels = torch.from_numpy(np.ascontiguousarray(image)).to(self.device)
        pixels = pixels.permute(2, 0, 1).to(torch.float32) / 127.5 - 1.0  # [3, H, W] in [-1, 1]
        video = pixels[None, :, None].expand(1, 3, frames, height, width).to(self.dtype)  # [1, 3, F, H, W]
        with self._lock:
            raw = self.model.encode(video).latent_dist.mode()
        return self.normalize(raw).to(torch.float32).contiguous()

    @torch.inference_mode()
    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 (F, H, W, 3), already resized (`media.video_input.resize_video`) -> float32 normalised
        latents [1, 48, (F-1)//4 + 1, h, w]. Pixels map to [-1, 1] with diffusers' arithmetic
        (`x/255` then `2x-1`), so the V2V latents equal `Cosmos3OmniPipeline._encode_video`'s."""
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
            raise ValueError(f"frames must be uint8 (F, H, W, 3), got {frames.dtype} {frames.shape}")
        num_frames, height, width = frames.shape[:3]
        self.latent_shape(num_frames, height, width)  # validates the size
        pixels = torch.from_numpy(np.ascontiguousarray(frames)).to(self.device).to(torch.float32) / 255.0
        pixels = 2.0 * pixels - 1.0
        video = pixels.permute(3, 0, 1, 2)[None].to(self.dtype)  # [1, 3, F, H, W]
        with self._lock:
            raw = self.model.encode(video).latent_dist.mode()
        return self.normalize(raw).to(torch.float32).contiguous()

    @torch.inference_mode()
    def decode_pixels(self, latents: torch.Tensor) -> torch.Tensor:
        """Normalised latents [B, 48, T, h, w] -> float32 pixels [B, 3, F, H, W] in [-1, 1] (on the device)."""
        if latents.ndim != 5 or latents.shape[1] != self.z_dim:
            raise ValueError(f"latents must be [B, {self.z_dim}, T, h, w], got {tuple(latents.shape)}")
        z = self.denormalize(latents)
        with self._lock:
            if self.decoder is None:
                pixels = self.model.decode(z).sample
            else:
                pixels = self.decoder.decode(z, chunk_size=self.decode_chunk_size)
        return pixels.to(torch.float32)

    @staticmethod
    def pixels_to_uint8(pixels: torch.Tensor) -> torch.Tensor:
        """float [B, 3, F, H, W] in [-1, 1] -> uint8 [B, F, H, W, 3] (diffusers' np/PIL postprocess)."""
        x = (pixels.to(torch.float32) * 0.5 + 0.5).clamp(0, 1)
        return (x * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous()

    @torch.inference_mode()
    def decode_frames(self, latents: torch.Tensor) -> Iterator[np.ndarray]:
        """Normalised latents [48, T, h, w] -> `decode`'s uint8 frames chunk by chunk, (n_i, H, W, 3) host
        arrays (the frame-0 chunk, then 4 x decode_chunk_size frames a chunk; diffusers' decode: one chunk).
        On CUDA a chunk is copied to the host once the next chunk's decode is queued behind it, on a side
        stream that waits for its own chunk only: the GPU decodes on while the host copies, and no pinned
        memory is held. Holds the VAE lock until the last chunk, or until the generator is closed."""
        if latents.ndim != 4 or latents.shape[0] != self.z_dim:
            raise ValueError(f"latents must be [{self.z_dim}, T, h, w], got {tuple(latents.shape)}")
        z = self.denormalize(latents[None])
        cuda = z.device.type == "cuda"
        copies = torch.cuda.Stream(z.device) if cuda else None
        with self._lock:
            if self.decoder is None:
                chunks = iter([self.model.decode(z).sample])
            else:
                chunks = self.decoder.decode_chunks(z, chunk_size=self.decode_chunk_size)
            # (uint8 frames on the device, the event after them)
            pending: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
            for pixels in chunks:  # queues this chunk's decode on the device
                frames = self.pixels_to_uint8(pixels)[0]  # [n, H, W, 3]
                if pending is not None:
                    yield _to_host(*pending, copies)
                done = torch.cuda.Event() if cuda else None
                if done is not None:
                    done.record(torch.cuda.current_stream(z.device))
                pending = (frames, done)
            if pending is not None:
                yield _to_host(*pending, copies)

    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Normalised latents [B, 48, T, h, w] (or [48, T, h, w]) -> host uint8 (B, F, H, W, 3)
        (or (F, H, W, 3))."""
        squeeze = latents.ndim == 4
        frames = self.pixels_to_uint8(self.decode_pixels(latents[None] if squeeze else latents))
        out = frames.cpu().numpy()
        return out[0] if squeeze else out


def _to_host(
    frames: torch.Tensor, ready: torch.cuda.Event | None, stream: torch.cuda.Stream | None
) -> np.ndarray:
    """Device frames -> a host array, copied on `stream` once `ready` (recorded after them) has passed; the
    calling thread waits for this copy only (a copy to pageable memory returns when done)."""
    if ready is None:
        return frames.numpy()
    assert stream is not None, "a CUDA chunk's event comes with the copy stream"
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        return frames.to("cpu").numpy()
