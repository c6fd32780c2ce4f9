"""The ViT's outputs of recent images and videos, by content digest (vLLM's encoder cache).

A chat that repeats an image (the next turn of a conversation, another question on the same picture) needs
its ViT embeddings again for the rows the prefix cache does not cover (runner/und_prefill.py): an image whose
placeholder rows are cut by the last cached block, or any image once its blocks were evicted. `EncoderCache`
keeps each item's (embeddings [m, d], deepstack features, one [m, d] each) under the digest
runner/prefix_hashes.py computes when the prompt is built (grid + pixels), on the device, least recently used
first out past `max_tokens` visual tokens (each kept as a copy of its own rows, so the count bounds the
memory); `encode` runs the ViT once for all of the given items not in it.
The ViT attends within each item only (Qwen3-VL's cu_seqlens), so an item's outputs do not depend on the
items encoded with it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor

from worldserve.models.cosmos3.vision import VisionEncoder, VisionInputs

DEFAULT_ENCODER_CACHE_TOKENS = 16384
"""Visual tokens kept (on Cosmos3-Nano, bf16: 16 KiB of embeddings and deepstack features a token, 512 MiB;
a 720p image is ~900 tokens)."""


class EncoderCache:
    """digest -> (embeds [m, d], deepstack features) of recently encoded images / videos, LRU by tokens."""

    def __init__(self, vision: VisionEncoder, max_tokens: int = DEFAULT_ENCODER_CACHE_TOKENS) -> None:
        self.vision = vision
        self.max_tokens = max_tokens
        self._items: OrderedDict[bytes, tuple[Tensor, tuple[Tensor, ...]]] = OrderedDict()
        self._tokens = 0
        self.hits = self.misses = 0  # items found / encoded

    def __len__(self) -> int:
        return len(self._items)

    def encode(self, inputs: VisionInputs, digests: Sequence[bytes]) -> tuple[Tensor, tuple[Tensor, ...]]:
        """VisionEncoder.encode of `inputs` (items in order, item i's digest digests[i]), the items already
        cached taken from the cache: (embeds [M, d], deepstack features [M, d] each)."""
        if len(digests) != len(inputs.grid_thw) or self.max_tokens <= 0:
            return self.vision.encode(inputs)
        missing = [i for i, d in enumerate(digests) if d not in self._items]
        self.hits += len(digests) - len(missing)
        self.misses += len(missing)
        encoded: dict[bytes, tuple[Tensor, tuple[Tensor, ...]]] = {}
        if missing:
            sub = select_items(inputs, missing)
            vis, ds = self.vision.encode(sub)  # [m, d], each [m, d]
            counts = sub.tokens_per_image(self.vision.merge_size)
            for i, v, *feats in zip(missing, vis.split(counts), *(x.split(counts) for x in ds), strict=True):
                encoded[digests[i]] = (v, tuple(feats))
        parts = [encoded.get(d) or self._items[d] for d in digests]
        for d in digests:
            if d in self._items:
                self._items.move_to_end(d)
        for d, item in encoded.items():
            self._put(d, item)
        if len(parts) == 1:  # (one item: its tensors as they are, no copy)
            return parts[0]
        return torch.cat([p[0] for p in parts]), tuple(
            torch.cat(k) for k in zip(*(p[1] for p in parts), strict=True)
        )

    def _put(self, digest: bytes, item: tuple[Tensor, tuple[Tensor, ...]]) -> None:
        tokens = item[0].shape[0]
        if digest in self._items or tokens > self.max_tokens:
            return
        # copies: a split view would keep the whole pass's outputs alive (every item encoded with it, even
        # one too large to cache), unseen by the token count
        self._items[digest] = (item[0].clone(), tuple(x.clone() for x in item[1]))
        self._tokens += tokens
        while self._tokens > self.max_tokens:
            _, (old, _) = self._items.popitem(last=False)
            self._tokens -= old.shape[0]


def select_items(inputs: VisionInputs, items: Sequence[int]) -> VisionInputs:
    """The images / videos `items` (indices, in that order) of `inputs`: their patches and grid rows (`inputs`
    itself when that is all of them in order: no copy of the patches on the chat worker's thread)."""
    if list(items) == list(range(len(inputs.grid_thw))):
        return inputs
    patches = inputs.grid_thw.prod(-1).tolist()  # [n] patches of each item
    starts = [sum(patches[:i]) for i in range(len(patches))]
    return VisionInputs(
        patches=torch.cat([inputs.patches[starts[i] : starts[i] + patches[i]] for i in items]),
        grid_thw=inputs.grid_thw[list(items)], repeat=inputs.repeat,
    )  # fmt: skip
