"""Full-size models with random weights for the benchmark; no checkpoint is read.

Both transformers are built on the meta device (no host memory, no init kernels), materialised with
`to_empty` on the GPU and filled in place: weights ~ N(0, std), norm scales ~ N(1, std), never zeros
(zeros time faster than real data). diffusers' `Cosmos3OmniTransformer` is filled first; ours then gets
the very same tensors through its checkpoint loader (`load_checkpoint_tensor`, which fuses q/k/v and
gate/up), so the two compute the same function and their outputs can be compared. The VAEs are built
directly on the device with their default (random) init and cast to bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from worldserve.models.cosmos3.config import Cosmos3Config

# The real Nano Wan2.2 VAE (cosmos3-model.md §6.1) and a tiny stand-in with the same compression.
WAN22_VAE = dict(
    base_dim=160,
    decoder_base_dim=256,
    z_dim=48,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
    in_channels=12,
    out_channels=12,
    patch_size=2,
    is_residual=True,
    scale_factor_temporal=4,
    scale_factor_spatial=16,
)
TINY_VAE = {**WAN22_VAE, "base_dim": 8, "decoder_base_dim": 16, "num_res_blocks": 1}
WAN22_MEAN = [
    -0.2289,
    -0.0052,
    -0.1323,
    -0.2339,
    -0.2799,
    0.0174,
    0.1838,
    0.1557,
    -0.1382,
    0.0542,
    0.2813,
    0.0891,
    0.1570,
    -0.0098,
    0.0375,
    -0.1825,
    -0.2246,
    -0.1207,
    -0.0698,
    0.5109,
    0.2665,
    -0.2108,
    -0.2158,
    0.2502,
    -0.2055,
    -0.0322,
    0.1109,
    0.1567,
    -0.0729,
    0.0899,
    -0.2799,
    -0.1230,
    -0.0313,
    -0.1649,
    0.0117,
    0.0723,
    -0.2839,
    -0.2083,
    -0.0520,
    0.3748,
    0.0152,
    0.1957,
    0.1433,
    -0.2944,
    0.3573,
    -0.0548,
    -0.1681,
    -0.0667,
]
WAN22_STD = [
    0.4765,
    1.0364,
    0.4514,
    1.1677,
    0.5313,
    0.4990,
    0.4818,
    0.5013,
    0.8158,
    1.0344,
    0.5894,
    1.0901,
    0.6885,
    0.6165,
    0.8454,
    0.4978,
    0.5759,
    0.3523,
    0.7135,
    0.6804,
    0.5833,
    1.4146,
    0.8986,
    0.5659,
    0.7069,
    0.5338,
    0.4889,
    0.4917,
    0.4069,
    0.4999,
    0.6866,
    0.4093,
    0.5709,
    0.6065,
    0.6415,
    0.4944,
    0.5726,
    1.2042,
    0.5458,
    1.6887,
    0.3971,
    1.0600,
    0.3943,
    0.5537,
    0.5444,
    0.4089,
    0.7468,
    0.7744,
]


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


def build_diffusers_transformer(config: Cosmos3Config, device: torch.device, dtype: torch.dtype, seed: int):
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
):
    """Our Cosmos3Transformer (meta -> to_empty), weights copied from diffusers' `source` (same keys as a
    checkpoint) or, without one, filled at random."""
    from worldserve.models.cosmos3.transformer import Cosmos3Transformer

    with torch.device("meta"):
        model = Cosmos3Transformer(config, dtype=dtype)
    model = model.to_empty(device=device).eval().requires_grad_(False)
    if source is None:
        fill_random_(model, seed=seed)
    else:
        for key, tensor in source.state_dict().items():
            model.load_checkpoint_tensor(key, tensor)
    model.post_load()
    return model


def build_video_vae(device: torch.device, dtype: torch.dtype, *, tiny: bool = False):
    """Wan2.2 VAE (diffusers AutoencoderKLWan, Nano config) with random init, behind our VideoVAE."""
    from diffusers import AutoencoderKLWan

    from worldserve.models.cosmos3.vae import VideoVAE

    cfg = {**(TINY_VAE if tiny else WAN22_VAE), "latents_mean": WAN22_MEAN, "latents_std": WAN22_STD}
    with torch.device(device):
        model = AutoencoderKLWan(**cfg)
    return VideoVAE(model.to(dtype=dtype).eval().requires_grad_(False))


def build_audio_vae(device: torch.device, dtype: torch.dtype, *, tiny: bool = False):
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
