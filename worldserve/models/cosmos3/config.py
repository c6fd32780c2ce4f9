"""Cosmos3Config: the architecture of the Cosmos3 Mixture-of-Transformers, read from `transformer/config.json`.

The field names are exactly the keys diffusers' `Cosmos3OmniTransformer` writes into that file, so one
directory loads in both. Unknown keys (older converters' names, diffusers bookkeeping such as
`_class_name`) are kept aside in `extra_keys` and never change behaviour. `nano()` is the released
Cosmos3-Nano shape, `tiny()` the 2-layer test shape that `worldserve make-tiny` writes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SIZE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "latent_channel", "latent_patch_size",
               "patch_latent_dim", "base_fps", "sound_dim", "action_dim", "num_embodiment_domains")  # fmt: skip
"""Cosmos3Config's sizes: positive integers (sound_dim and action_dim may be None)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Cosmos3Config:
    hidden_size: int = 4096
    """Width of both towers."""
    intermediate_size: int = 12288
    """SwiGLU width of both towers."""
    num_hidden_layers: int = 36
    """Layers per tower (each layer holds an und and a gen copy)."""
    num_attention_heads: int = 32
    """Query heads."""
    num_key_value_heads: int = 8
    """K/V heads (GQA)."""
    head_dim: int = 128
    """Per-head width."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon for every norm."""
    rope_theta: float = 5_000_000.0
    """mRoPE base."""
    rope_scaling: dict | None = None
    """Qwen3-VL rope_scaling; only `mrope_section` is read (when rope_axes_dim is unset)."""
    rope_axes_dim: tuple[int, int, int] | None = None
    """Interleaved mRoPE sections (T, H, W) in frequency slots."""
    vocab_size: int = 151936
    """Rows of embed_tokens / lm_head."""
    attention_bias: bool = False
    """Biases on q/k/v/out projections of both towers."""
    attention_dropout: float = 0.0
    """Stored only (inference)."""
    hidden_act: str = "silu"
    """MLP activation; only SwiGLU ("silu") is supported."""
    qk_norm_for_text: bool = True
    """Per-head q/k RMSNorm in the und tower."""
    use_und_k_norm_for_gen: bool = False
    """Extra norm on und keys seen by gen queries (not used by Nano; refused)."""
    latent_channel: int = 48
    """Video latent channels (= VAE z_dim)."""
    latent_patch_size: int = 2
    """Spatial patch of the latent."""
    patch_latent_dim: int = 192
    """latent_patch_size**2 * latent_channel."""
    base_fps: int = 24
    """Reference fps of the temporal mRoPE axis."""
    enable_fps_modulation: bool = True
    """Video temporal ids advance base_fps/fps per latent frame."""
    unified_3d_mrope_reset_spatial_ids: bool = True
    """Spatial ids restart at 0 for each vision item."""
    unified_3d_mrope_temporal_modality_margin: int = 15000
    """Gap between the last text position and the first media position."""
    timestep_scale: float = 0.001
    """Network timestep = scheduler timestep * timestep_scale."""
    sound_gen: bool = False
    """Audio heads present (audio_proj_in/out, audio_modality_embed)."""
    sound_dim: int | None = None
    """Audio latent channels."""
    sound_latent_fps: float = 25.0
    """Audio latent frames per second."""
    action_gen: bool = False
    """Action heads present."""
    action_dim: int | None = None
    """Action row width."""
    num_embodiment_domains: int = 32
    """Rows of the action heads (diffusers' DomainAwareLinear; checked in the checkpoint, not loaded)."""
    extra_keys: dict = field(default_factory=dict, compare=False)
    """Keys of config.json this class does not know (kept for round trips, never read)."""

    def __post_init__(self) -> None:
        for name in SIZE_FIELDS:  # (a string or a negative size failed deep in torch, after loading began)
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be a positive integer")
        section = self.rope_axes_dim
        if section is None:
            section = (self.rope_scaling or {}).get("mrope_section", [24, 20, 20])
        axes = tuple(int(s) for s in section)
        object.__setattr__(self, "rope_axes_dim", axes)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.patch_latent_dim != self.latent_patch_size**2 * self.latent_channel:
            raise ValueError(
                f"patch_latent_dim={self.patch_latent_dim} != latent_patch_size**2 * latent_channel"
            )
        if sum(axes) != self.head_dim // 2:
            raise ValueError(
                f"rope_axes_dim {self.rope_axes_dim} must sum to head_dim/2 = {self.head_dim // 2}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (only 'silu', the Nano MLP)")
        if not self.qk_norm_for_text or self.use_und_k_norm_for_gen:
            raise ValueError(
                "only qk_norm_for_text=True, use_und_k_norm_for_gen=False (the Nano setting) is supported"
            )
        if self.sound_gen and not self.sound_dim:
            raise ValueError("sound_gen=True needs sound_dim")
        if self.action_gen and not self.action_dim:
            raise ValueError("action_gen=True needs action_dim")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cosmos3Config:
        known = {f.name for f in dataclasses.fields(cls)} - {"extra_keys"}
        kwargs = {k: v for k, v in data.items() if k in known}
        extra = {k: v for k, v in data.items() if k not in known}
        return cls(**kwargs, extra_keys=extra)

    @classmethod
    def from_json(cls, path: str | Path) -> Cosmos3Config:
        return cls.from_dict(json.loads(Path(path).read_text()))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra_keys"}
        out["rope_axes_dim"] = list(self.mrope_sections)
        return out

    @classmethod
    def nano(cls) -> Cosmos3Config:
        """The released nvidia/Cosmos3-Nano transformer."""
        return cls(
            rope_scaling={"rope_type": "default", "mrope_interleaved": True, "mrope_section": [24, 20, 20]},
            sound_gen=True,
            sound_dim=64,
            action_gen=True,
            action_dim=64,
        )

    @classmethod
    def tiny(cls, vocab_size: int = 263, sound: bool = True) -> Cosmos3Config:
        """diffusers' test scale: 2 layers, width 64, 4 query / 2 KV heads of 16."""
        return cls(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=vocab_size,
            rope_scaling={"rope_type": "default", "mrope_interleaved": True, "mrope_section": [4, 2, 2]},
            sound_gen=sound,
            sound_dim=64 if sound else None,
            action_gen=True,
            action_dim=64,
        )

    # ------------------------------------------------------------------ derived
    @property
    def mrope_sections(self) -> tuple[int, int, int]:
        """rope_axes_dim as __post_init__ resolved it (from rope_scaling's mrope_section when not given)."""
        assert self.rope_axes_dim is not None  # (__post_init__ always sets it)
        return self.rope_axes_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim
