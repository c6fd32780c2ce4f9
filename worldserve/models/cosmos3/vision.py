"""The Reasoner's vision side: Qwen3-VL image preprocessing, the ViT (vision_encoder/), and chat mRoPE ids.

- `ImagePreprocessor`: uint8 (H, W, 3) images -> pixel_values [P, 3*2*16*16] + grid_thw [n, 3], exactly
  Qwen3-VL's processor (transformers' Qwen2VL image processor, Pillow backend, built offline with Qwen3-VL's
  settings: resize to multiples of patch*merge = 32 within [min_pixels, max_pixels], rescale, normalise with
  mean = std = 0.5, repeat the single frame to the temporal patch of 2, patchify in merge-window order).
- `VisionEncoder`: transformers' `Qwen3VLVisionModel` loaded from the checkpoint's vision_encoder/ (the ViT
  is small next to the LM, so we use the reference module). `encode` -> merged embeddings [M, d_llm] (one
  row per <|image_pad|> token, M = P / merge**2) and the deepstack features, one [M, d_llm] per ViT index.
- `chat_positions`: Qwen3-VL `get_rope_index` for one sequence: text token k at (c, c, c) with a running
  cursor c; an image of merged grid (t, h, w) at (c + t_i, c + h_i, c + w_i); text after it continues at
  max + 1 (c += max(h, w)). Returned as float32 [3, N] plus the next free position (decode continues there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

QWEN3VL_MIN_PIXELS = 65536
"""Qwen3-VL's preprocessor_config `size.shortest_edge` (a pixel count, not an edge)."""
QWEN3VL_MAX_PIXELS = 16777216
"""Qwen3-VL's preprocessor_config `size.longest_edge`."""


@dataclass(frozen=True, slots=True)
class VisionInputs:
    pixel_values: Tensor
    """[P, C * temporal_patch * patch * patch] float32 patches, images one after another."""
    grid_thw: Tensor
    """[n_images, 3] long: (t, h, w) in patches (before the 2x2 merge)."""

    def tokens_per_image(self, merge_size: int) -> list[int]:
        """<|image_pad|> tokens each image expands to: t * h * w / merge**2."""
        return (self.grid_thw.prod(-1) // merge_size**2).tolist()


class ImagePreprocessor:
    """Qwen3-VL's image processor, constructed offline (no processor download)."""

    def __init__(
        self,
        *,
        patch_size: int = 16,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        min_pixels: int = QWEN3VL_MIN_PIXELS,
        max_pixels: int = QWEN3VL_MAX_PIXELS,
    ) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.merge_size = merge_size
        self._processor = Qwen2VLImageProcessorPil(
            patch_size=patch_size,
            temporal_patch_size=temporal_patch_size,
            merge_size=merge_size,
            image_mean=[0.5, 0.5, 0.5],
            image_std=[0.5, 0.5, 0.5],
            size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        )

    def __call__(self, images: Sequence[np.ndarray]) -> VisionInputs:
        """uint8 RGB (H, W, 3) arrays -> VisionInputs."""
        from PIL import Image

        pil = [Image.fromarray(np.ascontiguousarray(img)) for img in images]
        out = self._processor(images=pil, return_tensors="pt")
        return VisionInputs(pixel_values=out["pixel_values"].float(), grid_thw=out["image_grid_thw"].long())


class VisionEncoder:
    """The Qwen3-VL ViT + patch merger + deepstack mergers, from `<checkpoint>/vision_encoder`."""

    def __init__(self, model) -> None:
        self.model = model.eval()
        cfg = model.config
        self.patch_size: int = cfg.patch_size
        self.temporal_patch_size: int = cfg.temporal_patch_size
        self.merge_size: int = cfg.spatial_merge_size
        self.num_deepstack: int = len(cfg.deepstack_visual_indexes)

    @classmethod
    def from_pretrained(
        cls, folder: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
        vision_config: dict | None = None,
    ) -> VisionEncoder:  # fmt: skip
        """Load `folder` (a save_pretrained ViT, or bare safetensors + `vision_config` from the root config).

        Every weight must be present: a missing or unexpected key raises instead of leaving random weights."""
        from safetensors.torch import load_file
        from transformers import Qwen3VLVisionConfig
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        folder = Path(folder)
        if (folder / "config.json").is_file():
            config = Qwen3VLVisionConfig.from_pretrained(str(folder))
        elif vision_config is not None:
            config = Qwen3VLVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
        else:
            raise ValueError(f"{folder} has no config.json and no vision_config was given")
        state = {}
        for file in sorted(folder.glob("*.safetensors")):
            for key, tensor in load_file(file).items():
                state[key.removeprefix("model.").removeprefix("visual.")] = tensor
        with torch.device("meta"):
            model = Qwen3VLVisionModel._from_config(config, dtype=dtype)
        result = model.load_state_dict(state, strict=False, assign=True)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(
                f"vision encoder weights in {folder} do not match Qwen3VLVisionModel: missing "
                f"{result.missing_keys[:5]}, unexpected {result.unexpected_keys[:5]}"
            )
        _reset_nonpersistent_buffers(model, "cpu")  # off meta, so that .to() can move it
        model = model.to(device=device, dtype=dtype)
        _reset_nonpersistent_buffers(model, device)  # float32 RoPE frequencies, as from_pretrained keeps them
        return cls(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def preprocessor(self, *, min_pixels: int, max_pixels: int) -> ImagePreprocessor:
        return ImagePreprocessor(
            patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
            merge_size=self.merge_size, min_pixels=min_pixels, max_pixels=max_pixels,
        )  # fmt: skip

    @torch.inference_mode()
    def encode(self, inputs: VisionInputs) -> tuple[Tensor, tuple[Tensor, ...]]:
        """-> (embeds [M, d_llm], deepstack features (one [M, d_llm] per deepstack ViT layer))."""
        out = self.model(
            inputs.pixel_values.to(self.device, self.dtype), grid_thw=inputs.grid_thw.to(self.device)
        )
        return out.pooler_output, tuple(out.deepstack_features)


def chat_positions(
    input_ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]], merge_size: int
) -> tuple[Tensor, int]:
    """Qwen3-VL get_rope_index for one sequence -> (float32 [3, N], next position).

    Each run of consecutive `image_token_id`s is one image; grids[i] is its (t, h, w) patch grid."""
    ids = torch.as_tensor(list(input_ids), dtype=torch.long)
    is_img = (ids == image_token_id).tolist()
    parts: list[Tensor] = []
    cursor, k, n, image = 0, 0, len(is_img), 0
    while k < n:
        end = k
        while end < n and is_img[end] == is_img[k]:
            end += 1
        if not is_img[k]:
            parts.append(torch.arange(cursor, cursor + end - k).expand(3, -1))  # [3, L] text
            cursor += end - k
        else:
            if image >= len(grids):
                raise ValueError("more image placeholder runs than images")
            t, h, w = (int(x) for x in grids[image])
            h, w = h // merge_size, w // merge_size
            if end - k != t * h * w:
                raise ValueError(f"image {image}: {end - k} placeholders for a {t}x{h}x{w} merged grid")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cursor)  # [3, t*h*w]
            cursor += max(h, w)
            image += 1
        k = end
    if image != len(grids):
        raise ValueError(f"{len(grids)} images but {image} placeholder runs")
    pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return pos.float(), cursor


def _reset_nonpersistent_buffers(model, device: torch.device | str) -> None:
    """Buffers that are not in the state dict (RoPE inverse frequencies) were built on meta: rebuild them."""
    for module in model.modules():
        if type(module).__name__ == "Qwen3VLVisionRotaryEmbedding":
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))
