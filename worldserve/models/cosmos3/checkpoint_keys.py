"""The on-disk key names and shapes of a Cosmos3 `transformer/` checkpoint (diffusers layout, flat keys).

This table is the single source of truth for what a Cosmos3 transformer checkpoint holds: `make-tiny`
writes exactly these keys, the loader checks a real checkpoint against them (missing, unexpected and
mis-shaped keys are one error), and a test compares it with diffusers' `Cosmos3OmniTransformer`.
Shapes follow `nn.Linear`: [out, in].
"""

from __future__ import annotations

from worldserve.models.cosmos3.config import Cosmos3Config

# Per-layer keys as (und name, gen name, kind) where kind picks the shape below.
LAYER_KEY_PAIRS: tuple[tuple[str, str, str], ...] = (
    ("input_layernorm.weight", "input_layernorm_moe_gen.weight", "hidden"),
    ("self_attn.to_q.weight", "self_attn.add_q_proj.weight", "q"),
    ("self_attn.to_k.weight", "self_attn.add_k_proj.weight", "kv"),
    ("self_attn.to_v.weight", "self_attn.add_v_proj.weight", "kv"),
    ("self_attn.to_out.weight", "self_attn.to_add_out.weight", "o"),
    ("self_attn.norm_q.weight", "self_attn.norm_added_q.weight", "head"),
    ("self_attn.norm_k.weight", "self_attn.norm_added_k.weight", "head"),
    ("post_attention_layernorm.weight", "post_attention_layernorm_moe_gen.weight", "hidden"),
    ("mlp.gate_proj.weight", "mlp_moe_gen.gate_proj.weight", "up"),
    ("mlp.up_proj.weight", "mlp_moe_gen.up_proj.weight", "up"),
    ("mlp.down_proj.weight", "mlp_moe_gen.down_proj.weight", "down"),
)

# Keys kept in float32 on disk and in memory (diffusers' `_keep_in_fp32_modules`).
FP32_PREFIXES: tuple[str, ...] = ("time_embedder.",)


def _layer_shape(kind: str, c: Cosmos3Config) -> tuple[int, ...]:
    d = c.hidden_size
    return {
        "hidden": (d,),
        "head": (c.head_dim,),
        "q": (c.q_dim, d),
        "kv": (c.kv_dim, d),
        "o": (d, c.q_dim),
        "up": (c.intermediate_size, d),
        "down": (d, c.intermediate_size),
    }[kind]


UNLOADED_KEY_PREFIXES = ("action_",)
"""Checkpoint keys checked but not loaded: the action heads (cosmos3-model.md §1.3, §2.4; 34 MB on Nano),
which no request reaches (action generation, `action_mode`, is refused), as the Reasoner drops them."""


def transformer_checkpoint_shapes(c: Cosmos3Config) -> dict[str, tuple[int, ...]]:
    """Every key of the transformer checkpoint with its shape, in a stable order."""
    d = c.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (c.vocab_size, d),
        "norm.weight": (d,),
        "norm_moe_gen.weight": (d,),
        "lm_head.weight": (c.vocab_size, d),
        "proj_in.weight": (d, c.patch_latent_dim),
        "proj_in.bias": (d,),
        "proj_out.weight": (c.patch_latent_dim, d),
        "proj_out.bias": (c.patch_latent_dim,),
        "time_embedder.linear_1.weight": (d, 256),
        "time_embedder.linear_1.bias": (d,),
        "time_embedder.linear_2.weight": (d, d),
        "time_embedder.linear_2.bias": (d,),
    }
    if c.sound_gen:
        assert c.sound_dim is not None  # (Cosmos3Config refuses sound_gen without sound_dim)
        shapes.update(
            {
                "audio_proj_in.weight": (d, c.sound_dim),
                "audio_proj_in.bias": (d,),
                "audio_proj_out.weight": (c.sound_dim, d),
                "audio_proj_out.bias": (c.sound_dim,),
                "audio_modality_embed": (d,),
            }
        )
    if c.action_gen:
        n, a = c.num_embodiment_domains, c.action_dim
        assert a is not None  # (Cosmos3Config refuses action_gen without action_dim)
        shapes.update(
            {
                "action_proj_in.fc.weight": (n, a * d),
                "action_proj_in.bias.weight": (n, d),
                "action_proj_out.fc.weight": (n, d * a),
                "action_proj_out.bias.weight": (n, a),
                "action_modality_embed": (d,),
            }
        )
    for i in range(c.num_hidden_layers):
        for und, gen, kind in LAYER_KEY_PAIRS:
            shape = _layer_shape(kind, c)
            shapes[f"layers.{i}.{und}"] = shape
            shapes[f"layers.{i}.{gen}"] = shape
            if c.attention_bias and kind in ("q", "kv", "o"):
                shapes[f"layers.{i}.{und[: -len('weight')]}bias"] = (shape[0],)
                shapes[f"layers.{i}.{gen[: -len('weight')]}bias"] = (shape[0],)
    return shapes


def loaded_checkpoint_shapes(c: Cosmos3Config) -> dict[str, tuple[int, ...]]:
    """transformer_checkpoint_shapes but UNLOADED_KEY_PREFIXES: the keys our transformer loads."""
    return {
        k: v for k, v in transformer_checkpoint_shapes(c).items() if not k.startswith(UNLOADED_KEY_PREFIXES)
    }


def is_fp32_key(key: str) -> bool:
    return key.startswith(FP32_PREFIXES)


def count_parameters(c: Cosmos3Config) -> int:
    total = 0
    for shape in transformer_checkpoint_shapes(c).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total
