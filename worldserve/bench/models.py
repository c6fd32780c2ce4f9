"""Full-size models with random weights for the benchmark; no checkpoint is read.

Both transformers are built on the meta device (no host memory, no init kernels), materialised with
`to_empty` on the GPU and filled in place: weights ~ N(0, std), norm scales ~ N(1, std), never zeros
(zeros time faster than real data). diffusers' `Cosmos3OmniTransformer` is filled first; ours then gets
the very same tensors through its checkpoint loader (`load_checkpoint_tensor`, which fuses q/k/v and
gate/up), so the two compute the same function and their outputs can be compared. The VAEs are built
directly on the device with their default (random) init and cast to bf16.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.weights.tiny import NANO_VAE_CONFIG, TINY_VAE_CONFIG, WAN22_LATENTS_MEAN, WAN22_LATENTS_STD

if TYPE_CHECKING:
    from worldserve.models.cosmos3.audio_vae import AudioVAE
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer
    from worldserve.models.cosmos3.vae import VideoVAE

# The real Nano Wan2.2 VAE (cosmos3-model.md §6.1) and a tiny stand-in with the same compression, both
# exactly what make-tiny writes (real 48-channel statistics passed separately).
WAN22_VAE = {k: v for k, v in NANO_VAE_CONFIG.items() if k not in ("latents_mean", "latents_std")}
TINY_VAE = {k: v for k, v in TINY_VAE_CONFIG.items() if k not in ("latents_mean", "latents_std")}


@torch.no_grad()
def fill_random_(module: nn.Module, *, seed: int, std: float = 0.02) -> int:
    """Fill every parameter in place (norm scales around 1, everything else around 0); returns the count."""
    gen = None
    total = 0
    for name, p in module.named_parameters():
        if gen is None:
            gen = torch.Generator(device=p.device).manual_seed(seed)
        mean = 1.0 if ("norm" in name and p.ndim == 1) else 0.0
        p.normal_(mean, std, generator=gen)
        total += p.numel()
    return total


def build_diffusers_transformer(
    config: Cosmos3Config, device: torch.device, dtype: torch.dtype, seed: int
) -> Any:
    """diffusers' Cosmos3OmniTransformer with random weights, dtype as `from_pretrained(dtype=)` gives
    (time_embedder kept in float32, `_keep_in_fp32_modules`)."""
    from diffusers import Cosmos3OmniTransformer

    with torch.device("meta"):
        model = Cosmos3OmniTransformer(**config.to_dict())
    model = model.to(dtype=dtype)
    model.time_embedder.float()
    model = model.to_empty(device=device).eval().requires_grad_(False)
    # Non-persistent buffer left uninitialised by to_empty: recompute it as __init__ does.
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd))
    model.rotary_emb.inv_freq.copy_(inv_freq)
    fill_random_(model, seed=seed)
    return model


def build_our_transformer(
    config: Cosmos3Config, device: torch.device, dtype: torch.dtype, source: nn.Module | None, seed: int
) -> Cosmos3Transformer:
    """Our Cosmos3Transformer (meta -> to_empty), weights copied from diffusers' `source` (same keys as a
    checkpoint) or, without one, filled at random."""
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer

    with torch.device("meta"):
        model = Cosmos3Transformer(config, dtype=dtype)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    if source is None:
        fill_random_(model, seed=seed)
    else:
        loaded = model.loaded_shapes()  # (the action heads are not)
        for key, tensor in source.state_dict().items():
            if key in loaded:
                model.load_checkpoint_tensor(key, tensor)
    model.post_load()
    return model


def build_video_vae(
    device: torch.device,
    dtype: torch.dtype,
    *,
    tiny: bool = False,
    compile_decoder: bool = False,
    time_winograd: bool = True,
) -> VideoVAE:
    """Wan2.2 VAE (diffusers AutoencoderKLWan, Nano config) with random init, behind our VideoVAE
    (`compile_decoder`, `time_winograd`: as VideoPipeline.from_pretrained sets them, the latter off under
    layerwise offload)."""
    from diffusers import AutoencoderKLWan

    from worldserve.models.cosmos3.vae import VideoVAE

    cfg = {
        **(TINY_VAE if tiny else WAN22_VAE),
        "latents_mean": WAN22_LATENTS_MEAN,
        "latents_std": WAN22_LATENTS_STD,
    }
    with torch.device(device):
        model = AutoencoderKLWan(**cfg)
    return VideoVAE(
        model.to(dtype=dtype).eval().requires_grad_(False),
        compile_decoder=compile_decoder,
        time_winograd=time_winograd,
    )


def build_audio_vae(device: torch.device, dtype: torch.dtype, *, tiny: bool = False) -> AudioVAE:
    """The AVAE decoder (diffusers Cosmos3AVAEAudioTokenizer default = real config, decoder only), random
    init, weight norm folded as our AudioVAE does at load."""
    from diffusers import Cosmos3AVAEAudioTokenizer

    from worldserve.models.cosmos3.audio_vae import AudioVAE

    kw = {"dec_dim": 4} if tiny else {}
    with torch.device(device):
        model = Cosmos3AVAEAudioTokenizer(encoder_enabled=False, **kw)
    return AudioVAE(model.to(dtype=dtype))


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
