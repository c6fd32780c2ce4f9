"""The Reasoner's vision side: Qwen3-VL image preprocessing, the ViT (vision_encoder/), and chat mRoPE ids.

- `VisionInputs`: uint8 patches + grid_thw + digests; `pixel_values(device)` normalises them where the ViT
  runs (a ninth of the bytes on the host and over PCIe than the float values).
- `ImagePreprocessor`: uint8 (H, W, 3) images -> VisionInputs whose pixel_values [P, 3*2*16*16] are, bit for
  bit, Qwen3-VL's processor (transformers' Qwen2VL image processor, Pillow backend, with Qwen3-VL's settings:
  bicubic resize to multiples of patch*merge = 32 within [min_pixels, max_pixels], rescale, normalise with
  mean = std = 0.5, repeat the single frame to the temporal patch of 2, patchify in merge-window order),
  reimplemented: the reference's float64 and channels-first copies made it the larger part of an image
  chat's host time.
- `VisionEncoder`: transformers' `Qwen3VLVisionModel` loaded from the checkpoint's vision_encoder/ (its
  weights; our inference forward in vision_tower.py runs them, held to the reference's by tests). `encode`
  -> merged embeddings [M, d_llm] (one row per <|image_pad|> token, M = P / merge**2) and the deepstack
  features, one [M, d_llm] per ViT index.
- `video_inputs`: sampled, resized uint8 frames (media/video_input.py) -> VisionInputs, as Qwen3-VL's video
  processor finishes them (pad the frame count to the temporal patch with the last frame, patchify in
  merge-window order; rescaled and normalised with mean = std = 0.5 by pixel_values); `video_timestamps`:
  the seconds printed before each temporal patch (mean of its two frames' times), as Qwen3VLProcessor
  computes them.
- `chat_positions`: Qwen3-VL `get_rope_index` for one sequence: text token k at (c, c, c) with a running
  cursor c; an image of merged grid (t, h, w) at (c + t_i, c + h_i, c + w_i); text after it continues at
  max + 1 (c += max(h, w)). A video's temporal patches are separated by timestamp text, so each is placed
  like an image with t = 1. Returned as float32 [3, N] plus the next free position (decode continues there).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from worldserve.media.processor_cache import ProcessorCache
from worldserve.media.work_pool import map_in_order

QWEN3VL_MIN_PIXELS = 65536
"""Qwen3-VL's preprocessor_config `size.shortest_edge` (a pixel count, not an edge)."""
QWEN3VL_MAX_PIXELS = 16777216
"""Qwen3-VL's preprocessor_config `size.longest_edge`."""


@dataclass(frozen=True, slots=True)
class VisionInputs:
    patches: Tensor
    """[P, C * F * patch * patch] uint8 pixels in patch order, items one after another, F frames a patch: the
    temporal patch's for videos, 1 for images (`repeat` fills the temporal patch). Never written: the
    processor cache may hold the same tensor. A ninth of the float pixel values' bytes (no temporal copy,
    a byte a value) to build, keep and send to the GPU, where `pixel_values` normalises them."""
    grid_thw: Tensor
    """[n_images, 3] long: (t, h, w) in patches (before the 2x2 merge)."""
    digests: tuple[bytes, ...] | None = None
    """Each item's content digest where its maker computed one (ImagePreprocessor, video_inputs: from the
    uint8 pixels); None: runner/prefix_hashes.py hashes the patches."""
    repeat: int = 1
    """Times each stored frame is repeated to fill the temporal patch: the temporal patch size for images
    (one frame stored, F = 1), 1 for videos."""

    def tokens_per_image(self, merge_size: int) -> list[int]:
        """<|image_pad|> tokens each image expands to: t * h * w / merge**2."""
        return (self.grid_thw.prod(-1) // merge_size**2).tolist()

    def pixel_values(self, device: torch.device | str | None = None) -> Tensor:
        """The Qwen3-VL processor's pixel_values [P, C * temporal_patch * patch * patch] float32 on `device`:
        the uint8 patches moved there, normalised (v / 127.5 - 1 in float32 is, for every uint8 v, bit for bit
        the reference's float64(v) * (1 / 255) rounded to float32, then (x - 0.5) / 0.5; tests hold all 256
        values to it) and each frame repeated `repeat` times."""
        x = self.patches.to(device, non_blocking=True).float().div_(127.5).sub_(1.0)  # [P, C * F * p * p]
        if self.repeat == 1:
            return x
        n = x.shape[0]
        x = x.view(n, 3, 1, -1).expand(n, 3, self.repeat, x.shape[1] // 3)  # [P, C, T, p * p], F = 1
        return x.reshape(n, -1)


def video_inputs(
    frames: np.ndarray, *, patch_size: int = 16, temporal_patch_size: int = 2, merge_size: int = 2
) -> VisionInputs:
    """uint8 (N, H, W, 3) frames, H and W multiples of patch * merge -> uint8 patches [P, 3*2*p*p] (the frame
    count padded to the temporal patch with the last frame), grid [1, 3], and the digest: SHA-256 of the grid
    and the uint8 frames (which decide the patches)."""
    frames = np.ascontiguousarray(frames)
    x = torch.from_numpy(frames).permute(0, 3, 1, 2)  # [N, 3, H, W] uint8
    if pad := -x.shape[0] % temporal_patch_size:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    n, c, h, w = x.shape
    gt, gh, gw, m, p = n // temporal_patch_size, h // patch_size, w // patch_size, merge_size, patch_size
    x = x.reshape(gt, temporal_patch_size, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # [gt, gh/m, gw/m, m, m, C, tp, p, p]
    patches = x.reshape(gt * gh * gw, c * temporal_patch_size * p * p)
    digest = hashlib.sha256(np.asarray([gt, gh, gw], dtype=np.int64).tobytes())
    digest.update(b"uint8 video")
    digest.update(frames.data.cast("B"))  # (frames' buffer as bytes)
    return VisionInputs(patches=patches, grid_thw=torch.tensor([[gt, gh, gw]]), digests=(digest.digest(),))


def video_timestamps(indices: Sequence[int], source_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each temporal patch: the mean time of its first and last frame (last index repeated to
    fill the final patch)."""
    idx = list(indices)
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    t = [i / source_fps for i in idx]
    return [(t[i] + t[i + temporal_patch_size - 1]) / 2 for i in range(0, len(t), temporal_patch_size)]


def smart_resize(
    height: int, width: int, *, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Qwen2-VL's target size: (height, width) rounded to multiples of `factor`, then scaled (keeping the aspect
    ratio) into [min_pixels, max_pixels]. ValueError past a 200:1 aspect ratio, as the reference raises."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(
            f"absolute aspect ratio must be at most 200, got {max(height, width) / min(height, width)}"
        )
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


class ImagePreprocessor:
    """Qwen3-VL's image processor (transformers' Qwen2VLImageProcessorPil with Qwen3-VL's settings), our own
    implementation of it: the same output bit for bit (tests hold it to the reference), faster (no float64
    copy of the image, no channels-first round trips; bench/image_preprocess.py). Per image: Pillow's bicubic
    resize to smart_resize's size, then the uint8 pixels put straight into patch order, one frame (rescaled,
    normalised and repeated to the temporal patch by VisionInputs.pixel_values where the ViT runs). With a
    `cache` (media/processor_cache.py), an image given with its content key reuses the resized patches and
    digest of an earlier call that resized it to the same size."""

    def __init__(
        self,
        *,
        patch_size: int = 16,
        temporal_patch_size: int = 2,
        merge_size: int = 2,
        min_pixels: int = QWEN3VL_MIN_PIXELS,
        max_pixels: int = QWEN3VL_MAX_PIXELS,
        cache: ProcessorCache | None = None,
    ) -> None:
        self.patch_size = patch_size
        self.temporal_patch_size = temporal_patch_size
        self.merge_size = merge_size
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels
        self.cache = cache

    def __call__(
        self, images: Sequence[np.ndarray], *, keys: Sequence[bytes | None] = (), min_pixels: int | None = None,
        max_pixels: int | None = None,
    ) -> VisionInputs:  # fmt: skip
        """uint8 RGB (H, W, 3) arrays -> VisionInputs (with each image's digest); `keys`: each image's content
        key (media/processor_cache.py content_key of its file's bytes; None or absent: not cached);
        `min_pixels` / `max_pixels` override the pixel budget (`size.shortest_edge` / `.longest_edge`) for
        this call, as a request's mm_processor_kwargs do."""
        p, m = self.patch_size, self.merge_size
        lo, hi = min_pixels or self.min_pixels, max_pixels or self.max_pixels
        sizes = [
            smart_resize(i.shape[0], i.shape[1], factor=p * m, min_pixels=lo, max_pixels=hi) for i in images
        ]
        grids = [(1, h // p, w // p) for h, w in sizes]
        cache = self.cache
        cache_keys = [
            ("image patches", keys[i], h, w) if cache is not None and i < len(keys) and keys[i] else None
            for i, (h, w) in enumerate(sizes)
        ]
        found = [
            cache.get(k, counted=False) if cache is not None and k is not None else None for k in cache_keys
        ]
        todo = [i for i, f in enumerate(found) if f is None]  # resized at once (media/work_pool.py)
        made: dict[int, tuple[Tensor, bytes]] = {}
        for i, item in zip(
            todo, map_in_order(lambda i: self._patches(images[i], *sizes[i]), todo), strict=True
        ):
            made[i] = item
            key = cache_keys[i]
            if cache is not None and key is not None:
                cache.put(key, item, item[0].nbytes)
        done = [made[i] if f is None else f for i, f in enumerate(found)]  # (patches, digest) per image
        pieces = [f[0] for f in done] or [torch.empty(0, 3 * p * p, dtype=torch.uint8)]  # (no images: none)
        digests = [f[1] for f in done]
        return VisionInputs(  # (one image: its patches as they are kept, no copy; never written)
            patches=pieces[0] if len(pieces) == 1 else torch.cat(pieces),
            grid_thw=torch.tensor(grids, dtype=torch.long).view(-1, 3), digests=tuple(digests),
            repeat=self.temporal_patch_size,
        )  # fmt: skip

    def tokens(
        self, height: int, width: int, *, min_pixels: int | None = None, max_pixels: int | None = None
    ) -> int:
        """The prompt tokens of a height x width image under the pixel budget (overrides as in __call__);
        ValueError past a 200:1 aspect ratio."""
        f = self.patch_size * self.merge_size  # (one token: merge x merge patches)
        lo, hi = min_pixels or self.min_pixels, max_pixels or self.max_pixels
        h, w = smart_resize(height, width, factor=f, min_pixels=lo, max_pixels=hi)
        return (h // f) * (w // f)

    def _patches(self, img: np.ndarray, h: int, w: int) -> tuple[Tensor, bytes]:
        """One image resized to (h, w): its uint8 patches [gh * gw, 3 * p * p] in merge-window order (one frame:
        VisionInputs.pixel_values repeats it to the temporal patch), and its digest: SHA-256 of its grid and
        resized pixels."""
        from PIL import Image

        p, m = self.patch_size, self.merge_size
        pil = Image.fromarray(np.ascontiguousarray(img)).resize((w, h), resample=Image.Resampling.BICUBIC)
        pixels = np.array(pil)  # [h, w, 3] uint8 (a writable copy)
        gh, gw = h // p, w // p
        x = torch.from_numpy(pixels).view(gh // m, m, p, gw // m, m, p, 3)
        x = x.permute(0, 3, 1, 4, 6, 2, 5).contiguous()  # [gh/m, gw/m, m, m, 3, p, p] uint8, patch order
        digest = hashlib.sha256(np.asarray([1, gh, gw], dtype=np.int64).tobytes())
        digest.update(b"uint8 image")
        digest.update(pixels.data.cast("B"))  # (the pixels' buffer as bytes)
        return x.view(gh * gw, 3 * p * p), digest.digest()


class VisionEncoder:
    """The Qwen3-VL ViT + patch merger + deepstack mergers, from `<checkpoint>/vision_encoder`: transformers'
    module holds the weights, our inference forward (vision_tower.py) runs them."""

    def __init__(self, model: Any) -> None:
        from worldserve.models.cosmos3.vision_tower import VisionTower

        self.model = model.eval()
        self.tower = VisionTower(self.model)
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

        Every weight must be present: a missing, unexpected or mis-shaped key is a CheckpointError naming it."""
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
        from worldserve.weights.checkpoint import check_weights_match, readable_weights

        state = {}
        for file in sorted(folder.glob("*.safetensors")):
            with readable_weights(file):
                tensors = load_file(file)
            for key, tensor in tensors.items():
                state[key.removeprefix("model.").removeprefix("visual.")] = tensor
        with torch.device("meta"):
            model = Qwen3VLVisionModel._from_config(config, dtype=dtype)
        expected = model.state_dict()  # meta tensors: the names and shapes Qwen3VLVisionModel takes
        check_weights_match(
            folder,
            missing=[k for k in expected if k not in state],
            unexpected=[k for k in state if k not in expected],
            mismatched=[f"{k}: {tuple(state[k].shape)}, not {tuple(v.shape)}" for k, v in expected.items()
                        if k in state and state[k].shape != v.shape],
        )  # fmt: skip
        model.load_state_dict(state, strict=True, assign=True)
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

    def preprocessor(
        self, *, min_pixels: int, max_pixels: int, cache: ProcessorCache | None = None
    ) -> ImagePreprocessor:
        return ImagePreprocessor(
            patch_size=self.patch_size, temporal_patch_size=self.temporal_patch_size,
            merge_size=self.merge_size, min_pixels=min_pixels, max_pixels=max_pixels, cache=cache,
        )  # fmt: skip

    def set_attention_backend(self, name: str | None = None) -> str:
        """Route the ViT's attention through `name` (flash_attention.BACKENDS; None = auto: FA3 where it runs);
        the label."""
        from worldserve.models.layers.attention import any_shape_sdpa_attention, sdpa_attention
        from worldserve.models.layers.flash_attention import resolve_attention_backend

        cfg = self.model.config
        label, fn = resolve_attention_backend(name, self.device, self.dtype, cfg.hidden_size // cfg.num_heads)
        self.tower.attention = any_shape_sdpa_attention if fn is sdpa_attention else fn  # (an image's size)
        return label

    def encode(self, inputs: VisionInputs) -> tuple[Tensor, tuple[Tensor, ...]]:
        """-> (embeds [M, d_llm], deepstack features (one [M, d_llm] per deepstack ViT layer))."""
        pixels = inputs.pixel_values(self.device).to(self.dtype)  # (uint8 sent, normalised on the device)
        return self.tower.forward(pixels, inputs.grid_thw)


def chat_positions(
    input_ids: Sequence[int], image_token_id: int, grids: Sequence[Sequence[int]], merge_size: int,
    *, video_token_id: int | None = None, video_grids: Sequence[Sequence[int]] = (),
) -> tuple[Tensor, int]:  # fmt: skip
    """Qwen3-VL get_rope_index for one sequence -> (float32 [3, N], next position).

    Each run of consecutive `image_token_id`s is one image; grids[i] is its (t, h, w) patch grid. Each run
    of `video_token_id`s is one temporal patch of a video: video_grids (t, h, w) give t runs of (1, h, w)."""
    ids = torch.as_tensor(list(input_ids), dtype=torch.long)
    flat_video = [(1, h, w) for t, h, w in (tuple(int(x) for x in g) for g in video_grids) for _ in range(t)]
    if video_token_id is not None:  # (with no video, a typed video placeholder is a run too many: an error)
        kind = torch.where(ids == image_token_id, 1, torch.where(ids == video_token_id, 2, 0)).tolist()
        return _positions(kind, {1: list(grids), 2: flat_video}, merge_size)
    return _positions((ids == image_token_id).int().tolist(), {1: list(grids)}, merge_size)


def _positions(kind: Sequence[int], grids: dict[int, list], merge_size: int) -> tuple[Tensor, int]:
    """kind[k]: 0 for text, else the modality (1 image, 2 video patch) whose next grid a run of it takes."""
    names = {1: "image", 2: "video frame group"}
    used = dict.fromkeys(grids, 0)
    parts: list[Tensor] = []
    cursor, k, n = 0, 0, len(kind)
    while k < n:
        end = k
        while end < n and kind[end] == kind[k]:
            end += 1
        m = kind[k]
        if not m:
            parts.append(torch.arange(cursor, cursor + end - k).expand(3, -1))  # [3, L] text
            cursor += end - k
        else:
            if used[m] >= len(grids[m]):
                raise ValueError(f"more {names[m]} placeholder runs than {names[m]}s")
            t, h, w = (int(x) for x in grids[m][used[m]])
            h, w = h // merge_size, w // merge_size
            if end - k != t * h * w:
                raise ValueError(
                    f"{names[m]} {used[m]}: {end - k} placeholders for a {t}x{h}x{w} merged grid"
                )
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + cursor)  # [3, t*h*w]
            cursor += max(h, w)
            used[m] += 1
        k = end
    for m, g in grids.items():
        if used[m] != len(g):
            raise ValueError(f"{len(g)} {names[m]}s but {used[m]} placeholder runs")
    pos = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
    return pos.float(), cursor


def _reset_nonpersistent_buffers(model: Any, device: torch.device | str) -> None:
    """Buffers that are not in the state dict (RoPE inverse frequencies) were built on meta: rebuild them."""
    for module in model.modules():
        if type(module).__name__ == "Qwen3VLVisionRotaryEmbedding":
            fresh = type(module)(module.config)
            for name, buf in fresh.named_buffers(recurse=False):
                setattr(module, name, buf.to(device))
