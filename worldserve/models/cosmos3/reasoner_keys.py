"""The Reasoner view of a Cosmos3 checkpoint: which keys a Qwen3-VL model reads, under which names.

cosmos3-model.md §1.4: drop every gen-tower, video-head, sound and action key; rename the und attention
projections to Qwen names and prefix the text stack with `model.language_model.` and the ViT with
`model.visual.`; `lm_head.` stays top-level. The result loads strictly into transformers'
`Qwen3VLForConditionalGeneration` (a test proves it on the tiny checkpoint).
"""

from __future__ import annotations

import re

DROP_PATTERNS = tuple(
    re.compile(p)
    for p in (
        r"_moe_gen",
        r"^llm2vae\.",
        r"^vae2llm\.",
        r"^proj_in\.",
        r"^proj_out\.",
        r"^time_embedder\.",
        r"^latent_pos_embed$",
        r"\.self_attn\.add_[qkv]_proj\.",
        r"\.self_attn\.to_add_out\.",
        r"\.self_attn\.norm_added_[qk]\.",
        r"llm2sound",
        r"sound2llm",
        r"sound_modality_embed",
        r"audio_proj_(in|out)",
        r"audio_modality_embed",
        r"llm2action",
        r"action2llm",
        r"action_modality_embed",
        r"action_proj_(in|out)",
    )
)
ATTN_RENAMES = {
    ".self_attn.to_q.": ".self_attn.q_proj.",
    ".self_attn.to_k.": ".self_attn.k_proj.",
    ".self_attn.to_v.": ".self_attn.v_proj.",
    ".self_attn.to_out.": ".self_attn.o_proj.",
    ".self_attn.norm_q.": ".self_attn.q_norm.",
    ".self_attn.norm_k.": ".self_attn.k_norm.",
}
TEXT_PREFIXES = ("embed_tokens.", "layers.", "norm.")
VISION_PREFIXES = ("blocks.", "merger.", "patch_embed.", "pos_embed.", "deepstack_merger_list.")


def reasoner_key(key: str) -> str | None:
    """Checkpoint key (transformer/ or vision_encoder/) -> Qwen3-VL key, or None when the Reasoner drops it."""
    if any(p.search(key) for p in DROP_PATTERNS):
        return None
    for old, new in ATTN_RENAMES.items():
        key = key.replace(old, new)
    if key.startswith("lm_head."):
        return key
    if key.startswith(TEXT_PREFIXES):
        return "model.language_model." + key
    if key.startswith("visual."):
        return "model." + key
    if key.startswith(VISION_PREFIXES):
        return "model.visual." + key
    return None
