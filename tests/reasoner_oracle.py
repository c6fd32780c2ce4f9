"""Test helper: transformers' Qwen3VLForConditionalGeneration holding a Cosmos3 checkpoint's Reasoner subset.

Built from the root config.json (text_config, vision_config, token ids) and every root-index tensor mapped
through `reasoner_key` (cosmos3-model.md §1.4), loaded strictly in float32: the oracle for the und tower,
the vision encoder and Reasoner decoding.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from worldserve.models.cosmos3.reasoner_keys import reasoner_key


def reasoner_state(ckpt: Path) -> dict:
    """{Qwen3-VL key: float32 tensor} of every checkpoint tensor the Reasoner reads."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    state = {}
    for file in sorted(set(index.values())):
        for key, t in load_file(ckpt / file).items():
            name = reasoner_key(key)
            if name is not None:
                state[name] = t.float()
    return state


def qwen3vl_oracle(ckpt: Path):
    """(model, load_state_dict result) with the Reasoner weights loaded strictly, in eval mode."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    root = json.loads((ckpt / "config.json").read_text())
    cfg = Qwen3VLConfig(
        text_config=root["text_config"],
        vision_config=root["vision_config"],
        image_token_id=root["image_token_id"],
        video_token_id=root["video_token_id"],
        vision_start_token_id=root["vision_start_token_id"],
        vision_end_token_id=root["vision_end_token_id"],
        tie_word_embeddings=False,
    )
    model = Qwen3VLForConditionalGeneration(cfg).eval()
    result = model.load_state_dict(reasoner_state(ckpt), strict=True)
    return model, result
