"""Our Wan2.2 VAE decoder (diffusers `AutoencoderKLWan` with is_residual=True, decode only), built for speed.

Input: raw (denormalised) latents [B, z_dim, T, h, w]; output: pixels [B, 3, 1 + 4(T-1), 16h, 16w] in [-1, 1],
in the weights' dtype. It loads the `decoder.*` and `post_quant_conv.*` tensors of a diffusers `vae/` folder
unchanged and computes diffusers' decode: same math and causal semantics; float32 on the CPU it matches to
~1e-7 relative (not bit for bit: the Winograd convs and the spatial upsamplers sum their products in another
order, see below).

Why it is faster on a GPU (diffusers: 9.46 s at 720p x 189 frames on an H200, bench/results/README.md):
- latent frames go in chunks: frame 0 alone (it decodes to one pixel frame), then `chunk_size` frames at
  a time, not one by one, so each conv runs on a bigger batch with far fewer launches; causality is kept by
  an explicit `CausalConvCache` (per causal conv, the last 2 frames of its input), not by clone/cat/pad of
  a `feat_idx` list;
- activations stay channels_last_3d on CUDA (no cuDNN NCHW<->NHWC transposes);
- the residual blocks' causal 3x3x3 convs (~90 % of the FLOPs) run as Winograd F(2, 3) along time
  (`TimeWinogradConv3d`, wan_decoder_convs.py): 4 spatial 3x3 convs per pair of output frames instead of 6,
  plus elementwise transforms that fuse, compiled, into the norm / SiLU / residual kernels. Compiled decode
  at 720p x 189 frames on an H200: 4.68 -> 3.79 s; its error against a float32 decode stays at diffusers'
  bf16 level (PSNR 52.9 vs 52.3 dB; the plain convs 54.2 dB; bench/results/README.md, twelfth session).
  `set_time_winograd(False)` restores the plain Conv3d calls;
- the 3 spatial upsamplers (nearest-exact 2x + Conv2d 3x3, 13.6% of the 3.21 PFLOP decode) run sub-pixel
  (`SubpixelUp2xConv`): one 2x2 conv with 4x the output channels on the low-res frame padded by 1 (its
  2x2 taps are sums of the 3x3 ones, one kernel per output phase) and one interleaving copy; 4 taps
  instead of 9 per output pixel, so 2.25x fewer FLOPs there (~240 TFLOP less at 720p x 189 frames), and
  no 4x nearest-upsampled tensor is written and read back;
- the head conv (256 -> 12 channels) is a Triton implicit GEMM with the clamp in its epilogue (`HeadConv3d`,
  wan_head_conv.py): 1.04x cuDNN's, 18 ms of a 720p x 189 decode;
- `compile()` torch.compiles the hot blocks so the RMS-norm / SiLU / context concat / residual elementwise
  work fuses, and the DupUp3D shortcut add with the upsampler's phase interleave. Static shapes: a
  shorter last chunk compiles its own graphs once (the first decode of that frame count; serve's warm-up
  decodes its shapes in full), rather than being zero-padded (at 720p x 189 frames, 47 = 11 x 4 + 3
  latent frames after the first: padding computed 1 latent frame in 48 for nothing, ~2 % of a decode).

Memory at 720p x 189 frames, bf16 (45x80 latents; traced with fake tensors, eager, chunk of k latent
frames): the widest tensors live in the last up block at 360x640 x 4k frames (512 ch: 0.94k GB, 256 ch:
0.47k GB), and the peak is its first residual block (input, norm output, context concat, shortcut):
3.32k GB, on top of 1.11 GB weights, 3.29 GB causal contexts (32 convs x 2 frames), 1.05 GB output and
~0.5 GB else: ~6.0 + 3.3k GB, so k = 2 (the default) ~13 GB, 4 ~19 GB, 6 ~26 GB, 8 ~33 GB, 10 ~39 GB (k = 1, diffusers'
schedule: ~9 GB; diffusers itself measured +13.1 GiB). Compiled, norm/SiLU/concat fuse into one buffer
(~1k GB less). cuDNN workspaces and allocator slack come on top. `chunk_size` is a parameter; every chunk
size gives the same numbers up to float rounding (float32 on the CPU: diffusers' to ~1e-7 in tests). The
Winograd convs add their transformed inputs (2 frames of C channels per output frame) and partial outputs:
measured peak 27.4 GiB allocated at k = 4 (21.0 GiB with plain convs); see DEFAULT_CHUNK_SIZE for k = 2.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worldserve.models.cosmos3.wan_decoder_blocks import (
    AttentionBlock,
    CausalConv3d,
    CausalConvCache,
    ResidualBlock,
    RMSNorm,
    Upsample,
    causal_input,
    last_frames,
)
from worldserve.models.cosmos3.wan_decoder_convs import TimeWinogradConv3d
from worldserve.models.cosmos3.wan_head_conv import HeadConv3d
from worldserve.models.layers.compile_limits import recompile_limits

DEFAULT_CHUNK_SIZE = 2
"""Latent frames per chunk after the first. At 720p x 189 on an H200, compiled with the Winograd convs
(bench/results/vae-decode-20261203-h200-compiled-chunk{2,4}.json): k = 2 decodes in 3.850 s holding 14.0 GiB
above what is resident and compiles in 36.7 s; k = 4 3.797 s, 22.9 GiB, 67.3 s. 1.4 % slower for 8.9 GiB less
and half the compile time. Eager under --enable-layerwise-offload (plain convs): k = 2 10.7 GiB, k = 4 16.9 GiB;
served on a 31 GiB cap, k = 4 ran out of memory beside the Reasoner's K/V, k = 2 passes
(serve-video-20261203-h200-offload-cap31.json)."""
CHECKPOINT_PREFIXES = ("decoder.", "post_quant_conv.")


@dataclass(frozen=True, slots=True, kw_only=True)
class WanDecoderConfig:
    """The decoder half of a diffusers `AutoencoderKLWan` config (Nano: cosmos3-model.md §6.1)."""

    z_dim: int = 48
    """Latent channels."""
    base_dim: int = 256
    """diffusers `decoder_base_dim` (falls back to `base_dim`): the width of the last up block."""
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    """Width multipliers, read from the last (widest, latent resolution) to the first."""
    num_res_blocks: int = 2
    """Residual blocks per up block, minus one (diffusers builds num_res_blocks + 1)."""
    temporal_upsample: tuple[bool, ...] = (True, True, False)
    """Per upsampling block, whether it doubles the frame count: diffusers' `temperal_downsample[::-1]`."""
    out_channels: int = 12
    """Channels out of conv_out: 3 * patch_size**2."""
    patch_size: int = 1
    """Pixel unpatchify factor (2 for Wan2.2)."""

    def __post_init__(self) -> None:
        if len(self.temporal_upsample) != len(self.dim_mult) - 1:
            raise ValueError(
                f"need {len(self.dim_mult) - 1} temporal_upsample flags, got {self.temporal_upsample}"
            )
        if self.out_channels % (self.patch_size**2):
            raise ValueError(f"out_channels {self.out_channels} is not a multiple of patch_size**2")

    @classmethod
    def from_diffusers(cls, cfg: Mapping) -> WanDecoderConfig:
        """From `AutoencoderKLWan.config` (or its config.json dict)."""
        if not cfg.get("is_residual", False):
            raise ValueError("only the Wan2.2 VAE (is_residual=True) decoder is implemented; use diffusers'")
        return cls(
            z_dim=int(cfg["z_dim"]),
            base_dim=int(cfg.get("decoder_base_dim") or cfg["base_dim"]),
            dim_mult=tuple(cfg["dim_mult"]),
            num_res_blocks=int(cfg["num_res_blocks"]),
            temporal_upsample=tuple(bool(f) for f in cfg["temperal_downsample"][::-1]),
            out_channels=int(cfg["out_channels"]),
            patch_size=int(cfg.get("patch_size") or 1),
        )

    @property
    def temporal_factor(self) -> int:
        """Pixel frames per latent frame after the first."""
        return 2 ** sum(self.temporal_upsample)


class MidBlock(nn.Module):
    """Residual, attention, residual at the latent resolution."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim), ResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([AttentionBlock(dim)])

    def run(self, x: Tensor, cache: CausalConvCache, *, first_chunk: bool) -> Tensor:
        x = self.resnets[0].run(x, cache, eager=first_chunk)
        x = (self.attentions[0].forward if first_chunk else self.attentions[0])(x)
        return self.resnets[1].run(x, cache, eager=first_chunk)


class UpBlock(nn.Module):
    """diffusers `WanResidualUpBlock`: residual blocks, then (all but the last block) an upsampler plus the
    parameter-free DupUp3D shortcut from the block's input."""

    def __init__(self, in_dim: int, out_dim: int, num_resnets: int, *, up: bool, temporal: bool) -> None:
        super().__init__()
        dims = [in_dim] + [out_dim] * num_resnets
        self.resnets = nn.ModuleList(ResidualBlock(i, o) for i, o in zip(dims[:-1], dims[1:], strict=True))
        self.upsampler = Upsample(out_dim, temporal=temporal) if up else None
        self.factor_t = 2 if temporal else 1

    def run(self, x: Tensor, cache: CausalConvCache, *, first_chunk: bool) -> Tensor:
        """[B, Cin, T, H, W] -> [B, Cout, T', 2H, 2W] (T' = 2T temporal, 1 on the first chunk) or same size."""
        x_in = x if self.upsampler is not None else None  # the shortcut's input (only held when used)
        for resnet in self.resnets:
            x = resnet.run(x, cache, eager=first_chunk)
        if self.upsampler is None:
            return x
        return self.upsampler.run(x, cache, first_chunk=first_chunk, shortcut=x_in, factor_t=self.factor_t)


class Decoder3d(nn.Module):
    """conv_in, mid block, up blocks, RMS-norm + SiLU + conv_out (diffusers `WanDecoder3d` names)."""

    def __init__(self, cfg: WanDecoderConfig) -> None:
        super().__init__()
        dims = [cfg.base_dim * m for m in (cfg.dim_mult[-1], *cfg.dim_mult[::-1])]
        self.conv_in = CausalConv3d(cfg.z_dim, dims[0], (3, 3, 3))
        self.mid_block = MidBlock(dims[0])
        n_up = len(cfg.dim_mult)
        self.up_blocks = nn.ModuleList(
            UpBlock(
                dims[i],
                dims[i + 1],
                cfg.num_res_blocks + 1,
                up=i < n_up - 1,
                temporal=i < n_up - 1 and cfg.temporal_upsample[i],
            )
            for i in range(n_up)
        )
        self.norm_out = RMSNorm(dims[-1])
        self.conv_out = HeadConv3d(dims[-1], cfg.out_channels)
        self.head_fn = self.head  # replaced by a compiled version in WanDecoder.compile

    def head(self, x: Tensor, ctx: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, C, T, H, W] -> (conv_out(SiLU(norm(x))) clamped to [-1, 1] [B, out, T, H, W], new context)."""
        a = causal_input(ctx, F.silu(self.norm_out(x), inplace=True))  # [B, C, 2 + T, H, W]
        return self.conv_out(a), last_frames(a)

    def forward(self, x: Tensor, cache: CausalConvCache, *, first_chunk: bool) -> Tensor:
        """One chunk: [B, z, T, h, w] -> [B, out_channels, T_pix, 8h, 8w] (T_pix = 1 for the first chunk)."""
        a = causal_input(cache.context(self.conv_in, x), x)  # [B, z, 2 + T, h, w]
        cache.update(self.conv_in, last_frames(a))
        x = self.mid_block.run(self.conv_in(a), cache, first_chunk=first_chunk)
        for up_block in self.up_blocks:
            x = up_block.run(x, cache, first_chunk=first_chunk)
        y, ctx = (self.head if first_chunk else self.head_fn)(x, cache.context(self.conv_out, x))
        cache.update(self.conv_out, ctx)
        return y


def chunk_bounds(num_frames: int, chunk_size: int) -> list[tuple[int, int]]:
    """Latent frame ranges: [0, 1), then `chunk_size` frames at a time (the last may be shorter)."""
    return [(0, 1)] + [(s, min(s + chunk_size, num_frames)) for s in range(1, num_frames, chunk_size)]


class WanDecoder(nn.Module):
    """post_quant_conv + the decoder, with the checkpoint's key names; `decode` is the entry point."""

    def __init__(self, config: WanDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.post_quant_conv = CausalConv3d(config.z_dim, config.z_dim, (1, 1, 1))
        self.decoder = Decoder3d(config)
        self.memory_format = torch.contiguous_format
        self.compiled = False

    @classmethod
    def from_diffusers(cls, vae: nn.Module) -> WanDecoder:
        """A copy of the decoder of a loaded diffusers `AutoencoderKLWan` (same device and dtype);
        channels_last_3d when it lives on CUDA."""
        state = {k: v.clone() for k, v in vae.state_dict().items() if k.startswith(CHECKPOINT_PREFIXES)}
        return cls._from_state(WanDecoderConfig.from_diffusers(vae.config), state)

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
    ) -> WanDecoder:
        """Load from a checkpoint's `vae/` folder (config.json + *.safetensors), reading decoder keys only."""
        from safetensors import safe_open

        folder = Path(folder)
        config = WanDecoderConfig.from_diffusers(json.loads((folder / "config.json").read_text()))
        state: dict[str, Tensor] = {}
        for file in sorted(folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt", device=str(device)) as f:
                for key in f.keys():
                    if key.startswith(CHECKPOINT_PREFIXES):
                        state[key] = f.get_tensor(key).to(dtype)
        return cls._from_state(config, state)

    @classmethod
    def _from_state(cls, config: WanDecoderConfig, state: dict[str, Tensor]) -> WanDecoder:
        with torch.device("meta"):
            model = cls(config)
        model.load_state_dict(state, strict=True, assign=True)  # raises on any missing/unexpected key
        model = model.eval().requires_grad_(False)
        if model.device.type == "cuda":
            model.set_memory_format(torch.channels_last_3d)
        return model

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    @torch.no_grad()
    def set_memory_format(self, memory_format: torch.memory_format) -> WanDecoder:
        """channels_last_3d (activations; conv weights to channels_last_3d / channels_last) or
        contiguous_format. Only the layout changes, never the values."""
        if memory_format not in (torch.channels_last_3d, torch.contiguous_format):
            raise ValueError(
                f"memory_format must be channels_last_3d or contiguous_format, got {memory_format}"
            )
        cl = memory_format == torch.channels_last_3d
        for p in self.parameters():
            if p.ndim in (4, 5):
                fmt = (torch.channels_last if p.ndim == 4 else torch.channels_last_3d) if cl else None
                p.data = p.data.contiguous(memory_format=fmt or torch.contiguous_format)
        self.memory_format = memory_format
        return self

    def set_time_winograd(self, on: bool) -> WanDecoder:
        """The residual blocks' 3x3x3 convs as Winograd F(2, 3) along time (the default: 1.5x fewer FLOPs,
        `wan_decoder_convs.TimeWinogradConv3d`) or as plain Conv3d calls. Same parameters either way."""
        for m in self.modules():
            if isinstance(m, TimeWinogradConv3d):
                m.time_winograd = on
        return self

    def compile(self, **kwargs: Any) -> WanDecoder:
        """torch.compile the hot blocks (residual, attention, upsample, head) with static shapes; meant for
        CUDA. `kwargs` go to torch.compile (e.g. mode=, backend=). The one-frame first chunk stays eager."""
        kwargs.setdefault("dynamic", False)
        for m in self.decoder.modules():
            if isinstance(m, ResidualBlock | AttentionBlock | Upsample):
                m.compile(**kwargs)
        self.decoder.head_fn = torch.compile(self.decoder.head, **kwargs)
        self.compiled = True
        return self

    def num_frames(self, latent_frames: int) -> int:
        """Pixel frames for T latent frames: 1 + 4(T-1)."""
        return 1 + self.config.temporal_factor * (latent_frames - 1)

    @torch.no_grad()
    def decode(self, z: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
        """Raw latents [B, z_dim, T, h, w] -> pixels [B, C, 1 + 4(T-1), H, W] in [-1, 1] (weights' dtype).
        `chunk_size` latent frames go through the decoder at once after the first (which goes alone)."""
        self._check(z, chunk_size)
        b, _, t, h, w = z.shape
        p, up = self.config.patch_size, 2 ** (len(self.config.dim_mult) - 1)
        c = self.config.out_channels // (p * p)
        out = torch.empty(
            (b, c, self.num_frames(t), h * up * p, w * up * p), dtype=self.dtype, device=self.device
        )
        frame = 0
        for y in self._decoded(z, chunk_size):
            n = y.shape[2]
            _unpatchify_into(out[:, :, frame : frame + n], y, p)
            frame += n
        return out

    @torch.no_grad()
    def decode_chunks(self, z: Tensor, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[Tensor]:
        """`decode`'s pixels chunk by chunk, each as soon as the decoder has made it: [B, C, n_i, H, W] of
        consecutive frames (n_0 = 1, then 4 x chunk_size, the last maybe fewer); the same numbers."""
        p = self.config.patch_size
        for y in self._decoded(z, chunk_size):
            b, cpp, n, h, w = y.shape  # [B, C*p*p, n, h', w']
            out = y.new_empty((b, cpp // (p * p), n, h * p, w * p))
            _unpatchify_into(out, y, p)
            yield out

    def _check(self, z: Tensor, chunk_size: int) -> None:
        if z.ndim != 5 or z.shape[1] != self.config.z_dim or z.shape[2] < 1:
            raise ValueError(f"z must be [B, {self.config.z_dim}, T >= 1, h, w], got {tuple(z.shape)}")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")

    def _decoded(self, z: Tensor, chunk_size: int) -> Iterator[Tensor]:
        """The decoder's raw output [B, C*p*p, n_i, h', w'] chunk after chunk (causal contexts carried)."""
        self._check(z, chunk_size)
        z = z.to(device=self.device, dtype=self.dtype).contiguous(memory_format=self.memory_format)
        x = self.post_quant_conv(z)  # [B, z, T, h, w]
        cache = CausalConvCache(self.memory_format)
        # Compiled: ResidualBlock.forward specialises on every (level, width, chunk length) of every output
        # size (8-24 graphs a size): dynamo may keep thousands (compile_limits.py), not fall back to eager.
        limit = recompile_limits() if self.compiled else contextlib.nullcontext()
        with limit:
            for start, stop in chunk_bounds(x.shape[2], chunk_size):
                yield self.decoder(x[:, :, start:stop], cache, first_chunk=start == 0)


def _unpatchify_into(dst: Tensor, y: Tensor, p: int) -> None:
    """dst [B, C, F, H*p, W*p] <- y [B, C*p*p, F, H, W], channel order (c, pw, ph) (diffusers' unpatchify)."""
    b, c, f, hp, wp = dst.shape
    h, w = hp // p, wp // p
    src = y.view(b, c, p, p, f, h, w).permute(0, 1, 4, 5, 3, 6, 2)  # [B, C, F, H, ph, W, pw]
    dst.view(b, c, f, h, p, w, p).copy_(src)
