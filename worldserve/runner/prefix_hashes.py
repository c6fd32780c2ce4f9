"""Prefix-cache keys of a chat's K/V blocks (models/layers/paged_kv.py: PagedKVPool.lookup / register).

The K/V of token t depend on every token up to t, on their mRoPE positions and, at image and video
placeholder rows, on the pixels (the ViT embeddings and deepstack features added there). So the key of block
j is SHA-256 over the key of block j-1, block j's token ids, their positions, and the digest of each image or
video whose placeholder rows start in block j (`media_digests`, computed once when the prompt is built, off
the chat worker: `ChatPrompt.media`); block 0's "parent" is the digest of the request's `cache_salt` (vLLM's
field), empty without one. Two chats share a block only when all of that is equal up to its end.
SHA-256 (vLLM's default hash too) keeps a crafted prompt from colliding with another client's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from worldserve.models.cosmos3.vision import VisionInputs
    from worldserve.runner.chat_prompt import ChatPrompt


def media_digests(
    ids: Sequence[int], vision: VisionInputs | None, video: VisionInputs | None, *, image_token_id: int,
    video_token_id: int, merge_size: int,
) -> tuple[tuple[int, bytes], ...]:  # fmt: skip
    """(first placeholder row, SHA-256 of its patch grid and uint8 patches, or the digest its VisionInputs carries) of
    every image and video of a prompt, in row order. Image / video i takes the next t*h*w / merge**2
    placeholder rows of its kind."""
    out = []
    for inputs, token in ((vision, image_token_id), (video, video_token_id)):
        if inputs is None:
            continue
        rows = [i for i, t in enumerate(ids) if t == token]
        grids = inputs.grid_thw.tolist()
        pixels = inputs.patches.cpu().contiguous()  # [P, C * F * p * p] uint8, items in order
        patch = row = 0
        for i, (grid, tokens) in enumerate(zip(grids, inputs.tokens_per_image(merge_size), strict=True)):
            n = grid[0] * grid[1] * grid[2]
            if inputs.digests is not None:  # the preprocessor's, of the pixels these patches came from
                out.append((rows[row], inputs.digests[i]))
            else:
                digest = hashlib.sha256(np.asarray([*grid, inputs.repeat], dtype=np.int64).tobytes())
                digest.update(memoryview(pixels[patch : patch + n].numpy()).cast("B"))
                out.append((rows[row], digest.digest()))
            patch, row = patch + n, row + tokens
    return tuple(sorted(out))


def block_hashes(prompt: ChatPrompt, generated: Sequence[int], block_size: int, tokens: int) -> list[bytes]:
    """Keys of the full blocks among the first `tokens` tokens of the prompt + `generated` (a preempted or
    finished chat's own tokens, at the positions their decode steps had)."""
    full = min(tokens, len(prompt.input_ids) + len(generated)) // block_size
    if full == 0:
        return []
    ids = np.asarray([*prompt.input_ids, *generated][: full * block_size], dtype=np.int64)
    positions = prompt.positions.numpy()  # [3, N] float32
    if len(generated) and positions.shape[1] < full * block_size:
        after = prompt.next_position + np.arange(len(generated), dtype=np.float32)
        positions = np.concatenate([positions, np.broadcast_to(after, (3, len(generated)))], axis=1)
    digests: dict[int, list[bytes]] = {}  # block -> the media starting in it, in row order
    for row, digest in prompt.media:
        digests.setdefault(row // block_size, []).append(digest)
    salt = prompt.cache_salt
    out, parent = [], b"" if salt is None else hashlib.sha256(b"cache_salt:" + salt.encode()).digest()
    for j in range(full):
        start, end = j * block_size, (j + 1) * block_size
        h = hashlib.sha256(parent)
        h.update(ids[start:end].tobytes())
        h.update(np.ascontiguousarray(positions[:, start:end]).tobytes())
        for digest in digests.get(j, ()):
            h.update(digest)
        parent = h.digest()
        out.append(parent)
    return out


def shared_blocks(a: Sequence[bytes], b: Sequence[bytes], start: int = 0, limit: int | None = None) -> int:
    """How many leading blocks two key lists share, counted on from `start` (known shared) up to `limit`: keys
    chain, so the first unequal key ends the shared prefix."""
    end = min(len(a), len(b)) if limit is None else min(len(a), len(b), limit)
    m = start
    while m < end and a[m] == b[m]:
        m += 1
    return m
