"""Our Qwen3-VL image preprocessing against transformers' Qwen2VLImageProcessorPil (the reference it replaces),
bit for bit, across sizes that round, upscale to min_pixels, downscale past max_pixels, and per-call overrides."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worldserve.models.cosmos3.vision import QWEN3VL_MAX_PIXELS, QWEN3VL_MIN_PIXELS, ImagePreprocessor


def _reference(min_pixels: int = QWEN3VL_MIN_PIXELS, max_pixels: int = QWEN3VL_MAX_PIXELS):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
    )  # fmt: skip


def _image(h: int, w: int, seed: int) -> np.ndarray:
    """A photo-like image (smooth gradients plus noise: bicubic overshoot and clipping both occur)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = 127 + 120 * np.sin(xx[..., None] / (7 + 3 * np.arange(3)) + yy[..., None] / 11)
    return np.clip(base + rng.normal(0, 40, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.mark.parametrize(
    ("h", "w"), [(720, 1280), (1080, 1920), (37, 53), (5, 900), (480, 481), (64, 64), (1000, 333)]
)
def test_equals_the_reference_bit_for_bit(h, w):
    img = _image(h, w, seed=h * w)
    ours = ImagePreprocessor()([img])
    ref = _reference()(images=[img], return_tensors="pt")
    assert torch.equal(ours.grid_thw, ref["image_grid_thw"].long())
    assert ours.pixel_values().dtype == torch.float32
    assert torch.equal(ours.pixel_values(), ref["pixel_values"].float())


def test_several_images_and_per_call_pixel_budgets_equal_the_reference():
    imgs = [_image(300, 500, 1), _image(1200, 900, 2), _image(90, 120, 3)]
    pre = ImagePreprocessor()
    for lo, hi in ((QWEN3VL_MIN_PIXELS, QWEN3VL_MAX_PIXELS), (4096, 200_000), (300_000, 600_000)):
        ours = pre(imgs, min_pixels=lo, max_pixels=hi)
        ref = _reference(lo, hi)(images=imgs, return_tensors="pt")
        assert torch.equal(ours.grid_thw, ref["image_grid_thw"].long())
        assert torch.equal(ours.pixel_values(), ref["pixel_values"].float())
        assert ours.grid_thw.prod(-1).sum() == ours.patches.shape[0]


def test_a_constructed_pixel_budget_is_the_default_of_each_call():
    img = _image(720, 1280, 4)
    ours = ImagePreprocessor(min_pixels=4096, max_pixels=100_000)([img])
    ref = _reference(4096, 100_000)(images=[img], return_tensors="pt")
    assert torch.equal(ours.pixel_values(), ref["pixel_values"].float())
    assert ours.grid_thw.prod() * 16 * 16 <= 100_000


def test_an_extreme_aspect_ratio_is_refused_as_the_reference_does():
    img = _image(2, 500, 5)
    with pytest.raises(ValueError, match="aspect ratio"):
        ImagePreprocessor()([img])
    with pytest.raises(ValueError, match="aspect ratio"):
        _reference()(images=[img], return_tensors="pt")


def test_every_uint8_value_normalises_as_the_reference_does():
    """The reference: float64(v) * (1 / 255) rounded to float32, then (x - 0.5) / 0.5 in float32. An image of
    every value at a size that needs no resampling carries each through unchanged."""
    v = np.arange(256, dtype=np.uint8)
    ref = ((v.astype(np.float64) * (1 / 255)).astype(np.float32) - np.float32(0.5)) / np.float32(0.5)
    img = np.broadcast_to(np.tile(v, 4)[None, :, None], (32, 1024, 3)).copy()
    out = ImagePreprocessor(min_pixels=32 * 1024, max_pixels=32 * 1024)([img])
    assert out.grid_thw.tolist() == [[1, 2, 64]]
    assert torch.equal(out.pixel_values().unique(), torch.from_numpy(ref))


def test_digests_follow_the_pixels_the_patches_come_from():
    """Equal images (and pixel budgets) share a digest (the prefix and encoder caches' key); one changed pixel,
    or a budget that resizes differently, gives another."""
    pre = ImagePreprocessor()
    img = _image(120, 200, 6)
    other = img.copy()
    other[60, 100, 1] ^= 1
    a, b, c = pre([img, img]), pre([img, other]), pre([img], max_pixels=64 * 64)
    assert a.digests is not None and len(a.digests) == 2 and a.digests[0] == a.digests[1]
    assert b.digests[0] == a.digests[0] and b.digests[1] != a.digests[0]
    assert c.digests[0] != a.digests[0]
