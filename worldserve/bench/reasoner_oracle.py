"""transformers' Qwen3VLForConditionalGeneration holding a Cosmos3 checkpoint's Reasoner subset: the oracle.

Built from the root config.json (text_config, vision_config, token ids) and every root-index tensor mapped
through `reasoner_key` (cosmos3-model.md §1.4), loaded strictly: the oracle for the und tower, the vision
encoder and Reasoner decoding, in float32 on the CPU for the tests (tiny checkpoint) and in float32 / bf16 on
the GPU for bench/reasoner_parity.py (full size).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from worldserve.models.cosmos3.reasoner_keys import reasoner_key


def reasoner_state(ckpt: Path, dtype: torch.dtype = torch.float32) -> dict:
    """{Qwen3-VL key: tensor in `dtype`} of every checkpoint tensor the Reasoner reads."""
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    state = {}
    for file in sorted(set(index.values())):
        for key, t in load_file(ckpt / file).items():
            name = reasoner_key(key)
            if name is not None:
                state[name] = t.to(dtype)
    return state


def qwen3vl_oracle(
    ckpt: Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    state: dict | None = None,
) -> tuple[Any, Any]:
    """(model, load_state_dict result) with the Reasoner weights loaded strictly, in eval mode.

    Built directly on `device` in `dtype` (its RoPE frequencies stay float32, as from_pretrained keeps
    them), so a full-size oracle costs no host-side init. `state`: reasoner_state(ckpt) read before (cast
    on loading), to build several oracles from one read."""
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
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(cfg, dtype=dtype).eval()
    result = model.load_state_dict(reasoner_state(ckpt, dtype) if state is None else state, strict=True)
    return model, result
