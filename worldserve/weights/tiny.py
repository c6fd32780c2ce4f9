"""`worldserve make-tiny`: a tiny random Cosmos3 checkpoint in exactly the on-disk layout of nvidia/Cosmos3-Nano.

Layout written (same file names and key names as the released repo):
  model_index.json, config.json, model.safetensors.index.json            (root side-cars)
  transformer/{config.json, diffusion_pytorch_model-0000k-of-0000N.safetensors, ...index.json}
  vae/ (AutoencoderKLWan, 48-ch latent, 4x16x16), sound_tokenizer/ (decoder-only AVAE, hop 1920)
  text_tokenizer/ (Qwen2Tokenizer with the real special tokens), vision_encoder/ (Qwen3-VL ViT)
  scheduler/scheduler_config.json
Every tensor comes from one seeded generator, so the same seed writes the same bytes. The folder loads
in diffusers' `Cosmos3OmniPipeline` and in our loader; its Reasoner subset in transformers' Qwen3-VL.

`shapes="nano"` writes the same layout at Cosmos3-Nano's real sizes (the 15.2B transformer in ~5 GB shards,
the Wan2.2 VAE, the default AVAE, Qwen3-VL-8B's ViT; ~32 GB, about two minutes): random weights for GPU
benchmarks and full-size runs of every path, with the tiny byte tokenizer (sampled ids past its vocabulary
decode to nothing, so texts are mostly empty while token counts are real).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from worldserve.models.cosmos3.checkpoint_keys import is_fp32_key, transformer_checkpoint_shapes
from worldserve.models.cosmos3.config import Cosmos3Config
from worldserve.weights.safetensors_shards import write_sharded
from worldserve.weights.tokenizer_fixture import special_token_ids, write_tiny_tokenizer

# Wan2.2 TI2V-5B latent statistics (cosmos3-model.md §6.3): kept real so normalisation is exercised.
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]  # fmt: skip
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]  # fmt: skip

TINY_VAE_CONFIG = {
    "base_dim": 8,
    "decoder_base_dim": 16,
    "z_dim": 48,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
    "dropout": 0.0,
    "is_residual": True,
    "in_channels": 12,
    "out_channels": 12,
    "patch_size": 2,
    "scale_factor_temporal": 4,
    "scale_factor_spatial": 16,
    "latents_mean": WAN22_LATENTS_MEAN,
    "latents_std": WAN22_LATENTS_STD,
}
TINY_SOUND_CONFIG = {"dec_dim": 4, "vocoder_input_dim": 64, "encoder_enabled": False}
NANO_VAE_CONFIG = {  # Wan2.2 TI2V-5B's VAE, as Cosmos3-Nano ships it
    **TINY_VAE_CONFIG,
    "base_dim": 160,
    "decoder_base_dim": 256,
    "num_res_blocks": 2,
}
NANO_SOUND_CONFIG: dict = {}
"""diffusers' Cosmos3AVAEAudioTokenizer defaults."""
# The reference (native) flow schedule config; the shipped Karras config is not what the model was run with.
SCHEDULER_CONFIG = {
    "_class_name": "UniPCMultistepScheduler",
    "num_train_timesteps": 1000,
    "solver_order": 2,
    "solver_type": "bh2",
    "prediction_type": "flow_prediction",
    "predict_x0": True,
    "lower_order_final": True,
    "use_flow_sigmas": True,
    "use_karras_sigmas": False,
    "flow_shift": 10.0,
}
TINY_VISION_CONFIG = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0, 1],
    "hidden_act": "gelu_pytorch_tanh",
}
NANO_VISION_CONFIG = {  # Qwen3-VL-8B's ViT (cosmos3-model.md §1.5): ~0.58B parameters
    "depth": 27,
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": [8, 16, 24],
    "hidden_act": "gelu_pytorch_tanh",
}


def _nano_config(vocab: int, sound: bool) -> Cosmos3Config:
    config = Cosmos3Config.nano()
    if config.vocab_size < vocab:
        raise ValueError(f"a tokenizer of {vocab} ids does not fit Nano's {config.vocab_size}-row embedding")
    return config if sound else replace(config, sound_gen=False, sound_dim=None)


@dataclass(frozen=True, slots=True)
class CheckpointShapes:
    """The sizes of every component a random checkpoint gets."""

    transformer: Callable[[int, bool], Cosmos3Config]
    """(tokenizer vocab, sound) -> the transformer's config."""
    vae: dict
    """AutoencoderKLWan keyword arguments."""
    sound: dict
    """Cosmos3AVAEAudioTokenizer keyword arguments."""
    vision: dict
    """Qwen3VLVisionConfig keyword arguments (out_hidden_size comes from the transformer)."""
    shard_bytes: int
    """The transformer's safetensors shard size."""


SHAPES = {
    "tiny": CheckpointShapes(
        lambda vocab, sound: Cosmos3Config.tiny(vocab_size=vocab, sound=sound),
        TINY_VAE_CONFIG, TINY_SOUND_CONFIG, TINY_VISION_CONFIG, 256 * 1024,
    ),
    "nano": CheckpointShapes(
        _nano_config,
        NANO_VAE_CONFIG, NANO_SOUND_CONFIG, NANO_VISION_CONFIG, 5 * 2**30,
    ),
}  # fmt: skip


def _random_tensor(key: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Non-degenerate random values: unit-ish norms, 1/sqrt(fan_in) linears, small biases."""
    x = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) == 1 and "norm" in key:
        return 1.0 + 0.1 * x
    if key.endswith("modality_embed"):
        return 0.1 * x
    if key.endswith("bias") or key.endswith("bias.weight"):
        return 0.02 * x
    if key.startswith("embed_tokens"):
        return x
    fan_in = shape[-1] if len(shape) > 1 else 1
    return x / math.sqrt(fan_in)


_Built = TypeVar("_Built")


def _seeded_module(build: Callable[[], _Built], seed: int) -> _Built:
    import warnings

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # diffusers' AVAE uses the old weight_norm API
        torch.manual_seed(seed)
        return build()


def _save_quietly(module: Any, out: Path) -> None:
    from diffusers.utils import logging as dlogging

    was_enabled = dlogging.is_progress_bar_enabled()
    dlogging.disable_progress_bar()
    try:
        module.save_pretrained(str(out), safe_serialization=True)
    finally:
        if was_enabled:
            dlogging.enable_progress_bar()


def write_transformer(
    out: Path, config: Cosmos3Config, seed: int, shard_bytes: int = SHAPES["tiny"].shard_bytes
) -> dict[str, str]:
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, shape in transformer_checkpoint_shapes(config).items():
        t = _random_tensor(key, shape, gen)
        tensors[key] = t if is_fp32_key(key) else t.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    cfg = {"_class_name": "Cosmos3OmniTransformer", "_diffusers_version": "0.42.1", **config.to_dict()}
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return write_sharded(out, "diffusion_pytorch_model", tensors, shard_bytes)


def write_vae(out: Path, seed: int, config: dict = TINY_VAE_CONFIG) -> None:
    from diffusers import AutoencoderKLWan

    def build() -> AutoencoderKLWan:
        m = AutoencoderKLWan(**config)
        with torch.no_grad():  # RMS_norm scales start at 1; vary them so tests see a wrong gamma
            for name, p in m.named_parameters():
                if name.endswith("gamma"):
                    p.copy_(1.0 + 0.3 * torch.randn(p.shape))
        return m

    _save_quietly(_seeded_module(build, seed), out)


def write_sound_tokenizer(out: Path, seed: int, config: dict = TINY_SOUND_CONFIG) -> None:
    from diffusers import Cosmos3AVAEAudioTokenizer

    def build() -> Cosmos3AVAEAudioTokenizer:
        m = Cosmos3AVAEAudioTokenizer(**config)
        with torch.no_grad():  # Snake alpha/beta start at 0; give them values so the test sees them
            for name, p in m.named_parameters():
                if name.endswith(("alpha", "beta")):
                    p.normal_(0.0, 0.1)
        return m

    _save_quietly(_seeded_module(build, seed), out)


def write_vision_encoder(
    out: Path, seed: int, out_hidden_size: int, config: dict = TINY_VISION_CONFIG
) -> dict[str, str]:
    from transformers import Qwen3VLVisionConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cfg = Qwen3VLVisionConfig(**config, out_hidden_size=out_hidden_size)
    from transformers.utils import logging as tlogging

    model = _seeded_module(lambda: Qwen3VLVisionModel._from_config(cfg), seed)
    tlogging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        tlogging.enable_progress_bar()
    return {k: "vision_encoder/model.safetensors" for k in model.state_dict()}


def _root_config(config: Cosmos3Config, token_ids: dict[str, int], vision: dict | None) -> dict:
    text_config = {
        "model_type": "qwen3_vl_text",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "attention_bias": config.attention_bias,
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta,
            "mrope_interleaved": True,
            "mrope_section": list(config.rope_axes_dim or ()),  # (set by Cosmos3Config's __post_init__)
        },
        "tie_word_embeddings": False,
    }
    root = {
        "architectures": ["Cosmos3OmniForConditionalGeneration"],
        "model_type": "cosmos3_omni",
        "text_config": text_config,
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "eos_token_id": token_ids["<|im_end|>"],
        "tie_word_embeddings": False,
        "model": {"joint_attn_implementation": "two_way", "use_system_prompt": False, "resolution": "720"},
    }
    if vision is not None:
        root["vision_config"] = {
            "model_type": "qwen3_vl_vision",
            **vision,
            "out_hidden_size": config.hidden_size,
        }
    return root


COMPONENT_FOLDERS = ("transformer", "vae", "sound_tokenizer", "vision_encoder", "text_tokenizer", "scheduler")


def make_tiny(
    out_dir: str | Path, seed: int = 0, sound: bool = True, vision: bool = True, shapes: str = "tiny"
) -> Path:
    """Write the random checkpoint (`shapes`: "tiny" or "nano", see the module docstring) into `out_dir`
    (created; existing files overwritten, and the component folders of an earlier checkpoint there removed
    first: a component left out, or a shard of larger shapes, would stay behind) and return it."""
    out = Path(out_dir)
    for name in COMPONENT_FOLDERS:
        shutil.rmtree(out / name, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    sizes = SHAPES[shapes]
    vocab = write_tiny_tokenizer(out / "text_tokenizer")
    config = sizes.transformer(vocab, sound)
    written = write_transformer(out / "transformer", config, seed, sizes.shard_bytes)
    weight_map = {k: f"transformer/{f}" for k, f in written.items()}
    write_vae(out / "vae", seed + 1, sizes.vae)
    if sound:
        write_sound_tokenizer(out / "sound_tokenizer", seed + 2, sizes.sound)
    if vision:
        weight_map.update(
            write_vision_encoder(out / "vision_encoder", seed + 3, config.hidden_size, sizes.vision)
        )
    sched = out / "scheduler"
    sched.mkdir(exist_ok=True)
    (sched / "scheduler_config.json").write_text(
        json.dumps({**SCHEDULER_CONFIG, "_diffusers_version": "0.42.1"}, indent=2) + "\n"
    )
    index = {
        "_class_name": "Cosmos3OmniPipeline",
        "_diffusers_version": "0.42.1",
        "transformer": ["diffusers", "Cosmos3OmniTransformer"],
        "text_tokenizer": ["transformers", "Qwen2Tokenizer"],
        "vae": ["diffusers", "AutoencoderKLWan"],
        "scheduler": ["diffusers", "UniPCMultistepScheduler"],
        "sound_tokenizer": ["diffusers", "Cosmos3AVAEAudioTokenizer"] if sound else [None, None],
        "safety_checker": [None, None],
        "enable_safety_checker": False,
        "default_use_system_prompt": False,
        "use_native_flow_schedule": True,
    }
    (out / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    token_ids = special_token_ids(out / "text_tokenizer")
    (out / "config.json").write_text(
        json.dumps(_root_config(config, token_ids, sizes.vision if vision else None), indent=2) + "\n"
    )
    root_index = {"metadata": {"format": "pt"}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(root_index, indent=2) + "\n")
    return out
